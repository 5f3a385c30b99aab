"""Tool schemas are evaluated safely (issue #25): only local references, a validator that
cannot fetch, re2 patterns, bounded size and fan-out; and the item limits of a body.

The pure parts (``stream.schema_guard``, ``fields.check_item_limits``) are fed directly;
the refusals and the repair go through a gateway of the session in front of the simulator,
with a loopback listener standing in for "somewhere a ``$ref`` could point": it counts
every connection accepted, and must count none.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.errors import GatewayError
from gateway.protocols import fields
from gateway.stream import schema_guard
from gateway.stream.repair import repair_arguments
from gateway.stream.schema_guard import MAX_EXPANSION, MAX_SCHEMA_NODES, schema_hazard, validates
from tests.conftest import Gateway, Simulator
from tests.hostile import error_shape_problem

BACKTRACKING = "^(?:.?){90}$X"  # Python's re: seconds to tens of seconds on a short string


class Listener:
    """A loopback TCP listener that accepts, counts and holds every connection."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for conn in self._held:
            conn.close()
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def outside_refs(listener: Listener, tmp_path: Path) -> list[str]:
    """References pointing outside the schema: http, scheme-relative (no https needed), file."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"type": "string"}')
    return [f"http://127.0.0.1:{listener.port}/s.json", f"//127.0.0.1:{listener.port}/s.json", secret.as_uri()]


def fan_out(depth: int) -> dict[str, Any]:
    """An ``allOf`` fan-out: each level names the next twice (2**depth visits, ~80 B a level)."""
    defs = {f"a{i}": {"allOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]} for i in range(depth)}
    defs[f"a{depth}"] = {"type": "string"}
    return {"type": "object", "properties": {"city": {"$ref": "#/$defs/a0"}}, "$defs": defs}


def cyclic_fan_out() -> dict[str, Any]:
    """Fan-out through a cycle (no static bound sees it: each instance level doubles)."""
    return {
        "$defs": {
            "a": {"anyOf": [{"$ref": "#/$defs/b"}, {"$ref": "#/$defs/b"}]},
            "b": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["zz"]},
        },
        "$ref": "#/$defs/a",
    }


# -- the guard as a pure function ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "where", "says"),
    [
        ({"properties": {"a": {"$ref": "http://h/x"}}}, "properties.a.$ref", "only local references"),
        ({"properties": {"a": {"$ref": "//h/x"}}}, "properties.a.$ref", "only local references"),
        ({"properties": {"a": {"$ref": "file:///etc/passwd"}}}, "properties.a.$ref", "only local references"),
        ({"properties": {"a": {"$ref": "x.json#/a"}}}, "properties.a.$ref", "only local references"),
        ({"items": {"$dynamicRef": "https://h/meta#node"}}, "items.$dynamicRef", "only local references"),
        ({"allOf": [{"$recursiveRef": "http://h/"}]}, "allOf.0.$recursiveRef", "only local references"),
        ({"properties": {"a": {"$ref": "#/$defs/none"}}}, "properties.a.$ref", "does not resolve"),
        ({"properties": {"a": {"$ref": "#nowhere"}}}, "properties.a.$ref", "does not resolve"),
        ({"enum": [{"type": "string"}], "properties": {"a": {"$ref": "#/enum/0"}}}, "properties.a.$ref",
         "does not point at a subschema"),
        ({"properties": {"a": {"$id": "http://127.0.0.1/", "$ref": "#"}}}, "properties.a.$id", "nested $id"),
        (fan_out(17), "", f"more than {MAX_EXPANSION}"),
        ({"properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_NODES + 1)}}, None,
         f"more than {MAX_SCHEMA_NODES} subschemas"),
    ],
)
def test_unsafe_schemas_are_named(schema: dict[str, Any], where: str | None, says: str) -> None:
    hazard = schema_hazard(schema)
    assert hazard is not None
    if where is not None:
        assert hazard[0] == where
    assert says in hazard[1]


def test_real_schemas_are_safe() -> None:
    """pydantic ($defs + local $ref, recursive models), zod ($schema, definitions), anchors."""
    pydantic_style = {
        "$defs": {"Node": {"type": "object", "properties": {
            "name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}},
        "type": "object", "properties": {"root": {"$ref": "#/$defs/Node"}}, "required": ["root"],
    }
    zod_style = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                 "definitions": {"u": {"type": "string", "pattern": "^[a-z]+$"}},
                 "properties": {"unit": {"$ref": "#/definitions/u"}}, "additionalProperties": False}
    anchored = {"$defs": {"x": {"$anchor": "city", "type": "string"}}, "properties": {"c": {"$ref": "#city"}}}
    for schema in (pydantic_style, zod_style, anchored, fan_out(10), {"$id": "https://example.com/s", "type": "object"}):
        assert schema_hazard(schema) is None, schema
    assert validates({"root": {"name": "a", "kids": [{"name": "b", "kids": []}]}}, pydantic_style) is True
    assert validates({"root": {"kids": [1]}}, pydantic_style) is False
    assert validates({"unit": "celsius"}, zod_style) is True
    assert validates({"unit": "Celsius"}, zod_style) is False
    assert validates({"unit": "c", "extra": 1}, zod_style) is False
    assert validates({"c": 5}, anchored) is False


def test_patterns_run_on_re2_and_what_it_cannot_run_is_undecided() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": BACKTRACKING}}}
    assert validates({"city": "Paris"}, schema) is False  # linear time: no backtracking
    assert validates({"city": "Paris"}, {"properties": {"city": {"pattern": "^P(?=a)"}}}) is None  # lookahead
    keyed = {"type": "object", "patternProperties": {BACKTRACKING: {"type": "integer"}}, "additionalProperties": False}
    assert validates({"Paris": 1}, keyed) is False
    assert validates({"Paris": 1}, {"patternProperties": {"^P": {"type": "integer"}}, "additionalProperties": False}) is True


def test_fan_out_through_a_cycle_is_stopped_by_the_evaluation_budget() -> None:
    instance: dict[str, Any] = {}
    node = instance
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    assert schema_hazard(cyclic_fan_out()) is None  # nothing static sees it ...
    assert validates(instance, cyclic_fan_out()) is None  # ... the budget does: undecided, not a hang


def test_unique_items_is_linear_and_keeps_json_equality() -> None:
    schema = {"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}}
    assert validates({"l": [{"a": 1}, {"a": 1.0}]}, schema) is False  # 1 == 1.0 in JSON Schema
    assert validates({"l": [1, True]}, schema) is True  # a boolean is not a number
    assert validates({"l": [{"a": i} for i in range(50_000)]}, schema) is True


def test_the_validator_cannot_retrieve(listener: Listener, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with the static check out of the way, the validator's registry has no retrieve
    function: an outside reference is undecided, and no connection is ever opened."""
    monkeypatch.setattr(schema_guard, "schema_hazard", lambda schema: None)
    for ref in outside_refs(listener, tmp_path):
        assert validates({"city": "x"}, {"type": "object", "properties": {"city": {"$ref": ref}}}) is None, ref
        assert repair_arguments('```json\n{"city": "x"}\n```', {"properties": {"city": {"$ref": ref}}}) is None
    remote_meta = {"$schema": f"http://127.0.0.1:{listener.port}/meta", "$id": f"http://127.0.0.1:{listener.port}/r",
                   "type": "object", "properties": {"city": {"type": "string"}}}
    assert validates({"city": "x"}, remote_meta) is True  # known keywords apply; the URLs are names only
    assert listener.accepted == 0


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": [{"role": "user"}] * (fields.MAX_MESSAGES + 1)}, "messages", "too_many_messages"),
        ({"input": [{"role": "user"}] * (fields.MAX_MESSAGES + 1)}, "input", "too_many_input_items"),
        ({"tools": [{}] * (fields.MAX_TOOLS + 1)}, "tools", "too_many_tools"),
        ({"tools": [{"type": "namespace", "tools": [{}] * fields.MAX_TOOLS}, {}]}, "tools", "too_many_tools"),
        ({"stop": ["x"] * (fields.MAX_STOP_SEQUENCES + 1)}, "stop", "too_many_stop_sequences"),
        ({"stop_sequences": ["x"] * (fields.MAX_STOP_SEQUENCES + 1)}, "stop_sequences", "too_many_stop_sequences"),
        ({"system": [{}] * (fields.MAX_CONTENT_PARTS + 1)}, "system", "too_many_content_parts"),
        ({"messages": [{"role": "user", "content": [{}] * (fields.MAX_CONTENT_PARTS + 1)}]},
         "messages.0.content", "too_many_content_parts"),
        ({"input": [{}, {"content": [{}] * (fields.MAX_CONTENT_PARTS + 1)}]}, "input.1.content", "too_many_content_parts"),
        ({"messages": [{"tool_calls": [{}] * (fields.MAX_TOOLS + 1)}]}, "messages.0.tool_calls", "too_many_tool_calls"),
    ],
)
def test_item_limits_are_named(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(GatewayError) as caught:
        fields.check_item_limits(body)
    assert (caught.value.code, caught.value.param, caught.value.status) == (code, param, 400)


def test_item_limits_let_real_bodies_through() -> None:
    fields.check_item_limits({"messages": [{"role": "user", "content": [{}] * 100}] * 1000, "tools": [{}] * 128,
                              "stop": ["a", "b"], "system": [{}] * 3})
    with pytest.raises(GatewayError) as caught:
        fields.check_value_limits({"x": [[] for _ in range(fields.MAX_CONTAINERS)]})
    assert caught.value.code == "too_many_values"


# -- against the running app ----------------------------------------------------------------------


def _tools(route: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A request declaring one tool with ``schema``, in the route's shape."""
    if route == "/v1/chat/completions":
        return {"model": "fenced_json", "messages": [{"role": "user", "content": "weather?"}],
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]}
    if route == "/v1/responses":
        return {"model": "fenced_json", "input": "weather?",
                "tools": [{"type": "function", "name": "get_weather", "parameters": schema}]}
    return {"model": "fenced_json", "max_tokens": 64, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"name": "get_weather", "input_schema": schema}]}


PARAMS = {
    "/v1/chat/completions": "tools.0.function.parameters",
    "/v1/responses": "tools[0].parameters",  # the Responses room names list items so
    "/v1/messages": "tools.0.input_schema",
}


@pytest.mark.parametrize("route", list(PARAMS))
def test_outside_refs_are_refused_before_the_upstream(
    route: str, gateway: Gateway, simulator: Simulator, listener: Listener, tmp_path: Path
) -> None:
    schemas = [{"type": "object", "properties": {"city": {"$ref": ref}}} for ref in outside_refs(listener, tmp_path)]
    schemas += [fan_out(17), {"type": "object", "$defs": {"a": {"$id": f"http://127.0.0.1:{listener.port}/"}}}]
    for schema in schemas:
        simulator.clear()
        for stream in (False, True):
            response = httpx.post(gateway.url + route, json={**_tools(route, schema), "stream": stream}, timeout=30)
            assert response.status_code == 400, response.text
            body = response.json()
            assert error_shape_problem(route, body) is None, body
            if route != "/v1/messages":
                assert body["error"]["code"] == "invalid_tool_schema"
                assert body["error"]["param"].startswith(PARAMS[route]), body
            else:
                assert body["error"]["type"] == "invalid_request_error"
                assert PARAMS[route] in body["error"]["message"]
        assert [r for r in simulator.requests() if r["body"].get("tools")] == []
    assert listener.accepted == 0


def test_a_schema_naming_urls_still_repairs_without_a_connection(
    gateways: dict[str, Gateway], listener: Listener
) -> None:
    """``$schema`` and a root ``$id`` are names, not fetches: the fenced arguments are
    repaired against the schema (off the event loop) and no connection is opened."""
    schema = {"$schema": f"http://127.0.0.1:{listener.port}/meta", "$id": f"http://127.0.0.1:{listener.port}/tool",
              "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                                               "unit": {"type": "string"}}, "required": ["city"]}
    client = openai.OpenAI(base_url=gateways["compatible"].base_url, api_key="k" * 24,
                           _strict_response_validation=True, max_retries=0)
    completion = client.chat.completions.create(
        model="fenced_json", messages=[{"role": "user", "content": "weather?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": schema}}],
    )
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city":"Paris","unit":"celsius"}'
    assert listener.accepted == 0


def test_a_backtracking_pattern_means_no_local_repair_not_a_stall(gateways: dict[str, Gateway]) -> None:
    """Validated with re2 the pattern simply does not match: no local repair, the
    regenerations are asked for, and the answer is the protocol's 502 ``tool_call_invalid``."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": BACKTRACKING}}}
    client = openai.OpenAI(base_url=gateways["compatible"].base_url, api_key="k" * 24,
                           _strict_response_validation=True, max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model="fenced_json", messages=[{"role": "user", "content": "weather?"}],
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": schema}}],
        )
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == "tool_call_invalid"  # type: ignore[index]
