"""Hostile input (#14): strict validation before the upstream, bounded values, huge prompts.

Against a gateway of its own in front of a simulator of its own, so that "the upstream
received nothing" is read from a request log no other test writes to. The property test
posts arbitrary JSON values and mutated real bodies (``tests/hostile.py``) to the three
generation routes and ``count_tokens``: every answer is 2xx or the route's exact 4xx
shape, never 5xx, and a 4xx never follows an upstream call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.protocols import tokens
from gateway.protocols.fields import (
    MAX_DEPTH,
    MAX_KEY_CHARS,
    MAX_TEXT_CHARS,
    check_value_limits,
    object_schema_problem,
    schema_problem,
)
from gateway.protocols.tokens import PIECE_CHARS, _encoding, count_text
from gateway.simulator.server import TEXT, create_simulator_app
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway
from tests.hostile import (
    BAD_BODIES,
    BAD_FIELDS,
    DEEP_MARK,
    HOSTILE_VALUES,
    OPENAI_ROUTES,
    ROUTES,
    SEEDS,
    applicable,
    delete_path,
    encode,
    error_shape_problem,
    huge_prompt,
    paths,
    set_path,
    stream_problem,
)

JSON = {"content-type": "application/json"}


class OwnSimulator(Simulator):
    """The module's simulator, read over one kept-alive client (a fresh httpx client per
    call costs ~0.2 s here, mostly its TLS context)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.http = httpx.Client(base_url=url, timeout=30)

    def requests(self) -> list[dict[str, Any]]:
        return self.http.get("/_sim/requests").json()["requests"]  # type: ignore[no-any-return]

    def clear(self) -> None:
        self.http.delete("/_sim/requests")


@pytest.fixture(scope="module")
def own_simulator(server_loop: ServerLoop) -> Iterator[OwnSimulator]:
    sim = OwnSimulator(server_loop.serve(create_simulator_app()))
    yield sim
    sim.http.close()


@pytest.fixture(scope="module")
def hostile_gateway(
    server_loop: ServerLoop, own_simulator: OwnSimulator, tmp_path_factory: pytest.TempPathFactory
) -> Gateway:
    return start_gateway(server_loop, own_simulator, tmp_path_factory)


@pytest.fixture(scope="module")
def http(hostile_gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hostile_gateway.url, timeout=60) as client:
        yield client


def post(http: httpx.Client, sim: OwnSimulator, route: str, body: bytes) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """The answer, and the requests the upstream received for it."""
    sim.clear()
    response = http.post(route, content=body, headers=JSON)
    return response, sim.requests()


def assert_acceptable(route: str, response: httpx.Response, received: list[dict[str, Any]]) -> None:
    """2xx (a JSON body or a finished stream), or the route's exact 4xx shape with no upstream call."""
    status = response.status_code
    assert status < 500, (status, response.text[:300])
    if status >= 400:
        assert response.headers["content-type"].startswith("application/json")
        assert error_shape_problem(route, response.json()) is None, response.text[:300]
        assert received == [], (status, response.text[:300])
        return
    assert status == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        assert stream_problem(route, response.text) is None, response.text[-300:]
    else:
        assert isinstance(response.json(), dict)


# -- the limits and schema checks, as pure functions ---------------------------------------------


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def test_depth_limit_counts_levels_below_the_body() -> None:
    check_value_limits({"a": nested(MAX_DEPTH - 1)})  # the body's keys are level 1
    with pytest.raises(GatewayError) as caught:
        check_value_limits({"messages": [{"content": nested(MAX_DEPTH)}]})
    assert caught.value.code == "nesting_too_deep"
    assert caught.value.param is not None and caught.value.param.startswith("messages.0.content.0.0")


def test_string_and_key_limits_name_the_value() -> None:
    check_value_limits({"messages": [{"content": "x" * 2_000_000}]})  # a 2 M-character prompt is fine
    with pytest.raises(GatewayError) as caught:
        check_value_limits({"messages": [{"content": "x" * (MAX_TEXT_CHARS + 1)}]})
    assert (caught.value.code, caught.value.param) == ("string_too_long", "messages.0.content")
    with pytest.raises(GatewayError) as caught:
        check_value_limits({"metadata": {"k" * (MAX_KEY_CHARS + 1): "v"}})
    assert (caught.value.code, caught.value.param) == ("string_too_long", "metadata")


def test_non_finite_numbers_are_refused() -> None:
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(GatewayError) as caught:
            check_value_limits({"temperature": value})
        assert caught.value.param == "temperature"


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": 5}, "type"),
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "properties.a.type"),
        ({"type": "object", "properties": []}, "properties"),
        ({"type": "object", "required": "a"}, "required"),
        ({"type": "object", "properties": {"a": {"pattern": "("}}}, "properties.a.pattern"),
        ({"type": "object", "anyOf": []}, "anyOf"),
        ({"type": "object", "properties": {"a": {"items": [{"type": 1}]}}}, "properties.a.items.0.type"),
        ({"type": "object", "properties": {"a": {"maxLength": -1}}}, "properties.a.maxLength"),
        ({"type": "object", "properties": {"a": 3}}, "properties.a"),
    ],
)
def test_schema_problems_name_the_keyword(schema: dict[str, Any], where: str) -> None:
    problem = schema_problem(schema)
    assert problem is not None and problem[0] == where


def test_real_schemas_pass() -> None:
    pydantic_style = {
        "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}},
        "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}, "unit": {"$ref": "#/$defs/Unit"},
                       "days": {"type": ["integer", "null"], "minimum": 1, "exclusiveMaximum": True}},
        "required": ["city"], "type": "object", "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }
    assert schema_problem(pydantic_style) is None
    assert object_schema_problem(pydantic_style) is None
    assert object_schema_problem({}) is None  # no type: any arguments object
    assert object_schema_problem({"type": "string"}) == ("type", "must describe an object (type 'object'), not 'string'")
    assert object_schema_problem([]) == ("", "must be a JSON schema object")


# -- token counts of any size -----------------------------------------------------------------------


def test_count_text_matches_the_tokenizer_below_its_limit_and_counts_beyond_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    words = ("lorem ipsum dolor sit amet, consectetur " * 30_000)[:900_000]
    assert count_text(words) == len(_encoding().encode_ordinary(words))  # pieces cut at spaces
    huge = words * 2 + words[:200_000]  # 2 M characters: the tokenizer alone refuses 1 M
    assert count_text(huge) == pytest.approx(count_text(words) * 2 + count_text(words[:200_000]), rel=0.001)
    assert count_text("😀" * (PIECE_CHARS * 2)) == len(_encoding().encode_ordinary("😀" * PIECE_CHARS)) * 2
    monkeypatch.setattr(tokens, "EXACT_CHARS", 100_000)  # beyond it: extrapolated at the counted rate
    assert count_text(words[:300_000]) == pytest.approx(3 * count_text(words[:100_000]), rel=0.001)


# -- every bad field, on every route ------------------------------------------------------------------


def named_problem(route: str, response: httpx.Response, field: str) -> str | None:
    """None when ``response`` is the route's exact 400 naming ``field``, else what is wrong."""
    if response.status_code != 400:
        return f"status {response.status_code}: {response.text[:200]}"
    body = response.json()
    shape = error_shape_problem(route, body)
    if shape is not None:
        return shape
    if body["error"]["type"] != "invalid_request_error":
        return f"type {body['error']['type']!r}"
    if route in OPENAI_ROUTES:
        param = body["error"]["param"]
        if param is None or param.replace("[", ".").split(".")[0] != field:
            return f"param {param!r}"
    elif field not in body["error"]["message"]:
        return f"message {body['error']['message']!r}"
    return None


@pytest.mark.parametrize("route", ROUTES)
def test_every_bad_field_is_a_named_400_and_nothing_goes_upstream(
    http: httpx.Client, own_simulator: OwnSimulator, route: str
) -> None:
    """Each known field with each of its bad values (``BAD_FIELDS``), in the first seed body
    it applies to; the upstream's log is read once at the end (no other test writes to it)."""
    own_simulator.clear()
    problems, tried = [], 0
    for path, values in BAD_FIELDS[route]:
        seed = next(s for s in SEEDS[route] if applicable(s, path))
        for value in values:
            response = http.post(route, content=encode(set_path(seed, path, value)), headers=JSON)
            tried += 1
            problem = named_problem(route, response, str(path[0]))
            if problem is not None:
                problems.append((".".join(map(str, path)), value, problem))
    assert problems == []
    assert tried > 50
    assert own_simulator.requests() == []


@pytest.mark.parametrize("route", ROUTES)
def test_a_body_that_is_no_request_is_a_400(http: httpx.Client, own_simulator: OwnSimulator, route: str) -> None:
    own_simulator.clear()
    for raw in BAD_BODIES:
        response = http.post(route, content=raw, headers=JSON)
        assert response.status_code == 400, (raw[:40], response.text[:200])
        assert error_shape_problem(route, response.json()) is None, (raw[:40], response.text[:200])
    assert own_simulator.requests() == []


@pytest.mark.parametrize("route", ROUTES)
def test_deep_nesting_anywhere_is_refused_naming_its_path(http: httpx.Client, own_simulator: OwnSimulator, route: str) -> None:
    for body in ({**SEEDS[route][0], "x_extra": DEEP_MARK}, set_path(SEEDS[route][1], ("messages", 0), DEEP_MARK)
                 if "messages" in SEEDS[route][1] else {**SEEDS[route][1], "input": [DEEP_MARK]}):
        response, received = post(http, own_simulator, route, encode(body))
        assert_acceptable(route, response, received)
        assert response.status_code == 400
        error = response.json()["error"]
        assert "nests deeper than 64 levels" in error["message"]
        if route in OPENAI_ROUTES:
            assert error["code"] == "nesting_too_deep" and error["param"].split(".")[0] in ("x_extra", "messages", "input")


# -- unknown fields: forwarded on Chat, ignored elsewhere ------------------------------------------------


def test_chat_forwards_engine_extras_and_unknown_keys(http: httpx.Client, own_simulator: OwnSimulator) -> None:
    extras = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "chat_template_kwargs": {"enable_thinking": False},
              "guided_json": {"type": "object"}, "x_vendor_flag": [1, "two"]}
    response, received = post(http, own_simulator, "/v1/chat/completions", encode({**SEEDS["/v1/chat/completions"][0], **extras}))
    assert response.status_code == 200, response.text
    assert len(received) == 1
    sent = received[0]["body"]
    assert {k: sent[k] for k in extras} == extras


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/messages"])
def test_responses_and_messages_ignore_unknown_keys(http: httpx.Client, own_simulator: OwnSimulator, route: str) -> None:
    body = {**SEEDS[route][0], "x_vendor_flag": {"a": [1]}, "top_k": 3} if route == "/v1/responses" else {
        **SEEDS[route][0], "x_vendor_flag": {"a": [1]}, "context_management": {"edits": []}}
    response, received = post(http, own_simulator, route, encode(body))
    assert response.status_code == 200, response.text
    assert len(received) == 1
    sent = received[0]["body"]
    assert "x_vendor_flag" not in sent and "context_management" not in sent
    assert route == "/v1/messages" or "top_k" not in sent  # top_k is not a Responses key


def test_a_tool_schema_with_a_dangling_ref_is_refused_before_the_upstream(
    http: httpx.Client, own_simulator: OwnSimulator
) -> None:
    """A ``$ref`` that resolves nowhere in the schema is a 400 ``invalid_tool_schema`` naming
    it (issue #25: only local references that resolve), and nothing goes upstream."""
    schema = {"type": "object", "properties": {"city": {"$ref": "#/$defs/missing"}}}
    body = {"model": "invalid_json", "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]}
    response, received = post(http, own_simulator, "/v1/chat/completions", encode(body))
    assert response.status_code == 400, response.text
    assert received == []
    error = response.json()["error"]
    assert error["code"] == "invalid_tool_schema" and error["param"] == "tools.0.function.parameters"
    assert "#/$defs/missing" in error["message"]


# -- a 2 M-character prompt ---------------------------------------------------------------------------------

HUGE_TEXT = huge_prompt("/v1/chat/completions", False)["messages"][0]["content"]


def openai_client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)


def anthropic_client(gateway: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="k", _strict_response_validation=True, max_retries=0)


# The simulator's "text" scenario answers a fixed text (echoing 2 M characters back would
# mostly measure the SDKs' own stream assembly); its usage is characters // 4 + 1.


def test_huge_prompt_chat(hostile_gateway: Gateway) -> None:
    client = openai_client(hostile_gateway)
    messages: Any = [{"role": "user", "content": HUGE_TEXT}]
    answer = client.chat.completions.create(model="text", messages=messages, timeout=60)
    assert answer.choices[0].message.content == TEXT
    assert answer.usage is not None and answer.usage.prompt_tokens == len(HUGE_TEXT) // 4 + 1
    with client.chat.completions.stream(model="text", messages=messages, stream_options={"include_usage": True},
                                        timeout=60) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == TEXT
    assert final.usage is not None and final.usage.prompt_tokens == len(HUGE_TEXT) // 4 + 1


def test_huge_prompt_responses(hostile_gateway: Gateway) -> None:
    client = openai_client(hostile_gateway)
    answer = client.responses.create(model="text", input=HUGE_TEXT, store=False, timeout=60)
    assert answer.output_text == TEXT
    assert answer.usage is not None and answer.usage.input_tokens == len(HUGE_TEXT) // 4 + 1
    with client.responses.stream(model="text", input=HUGE_TEXT, store=False, timeout=60) as stream:
        final = stream.get_final_response()
    assert final.output_text == TEXT
    assert final.usage is not None and final.usage.input_tokens == len(HUGE_TEXT) // 4 + 1


def test_huge_prompt_messages_counts_with_the_tokenizer(hostile_gateway: Gateway) -> None:
    """``usage=none``: the upstream reports no usage, so the gateway counts the 2 M-character
    prompt itself (this crashed the tokenizer: #14), in the JSON answer and in ``message_delta``."""
    client = anthropic_client(hostile_gateway)
    messages: Any = [{"role": "user", "content": HUGE_TEXT}]
    expected_in = count_text(HUGE_TEXT)
    assert expected_in > len(HUGE_TEXT) // 8  # words: about one token in five characters
    answer = client.messages.create(model="text;usage=none", max_tokens=16, messages=messages, timeout=60)
    assert answer.content[0].type == "text" and answer.content[0].text == TEXT
    assert expected_in <= answer.usage.input_tokens <= expected_in + 20
    assert answer.usage.output_tokens == count_text(TEXT)
    with client.messages.stream(model="text;usage=none", max_tokens=16, messages=messages, timeout=60) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == TEXT
    assert expected_in <= final.usage.input_tokens <= expected_in + 20
    assert final.usage.output_tokens == count_text(TEXT)
    counted = client.messages.count_tokens(model="echo", messages=messages, system=HUGE_TEXT)
    assert 2 * expected_in <= counted.input_tokens <= 2 * expected_in + 20


# -- the property ------------------------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(ROUTES))
    body = draw(st.sampled_from(SEEDS[route]))
    for _ in range(draw(st.integers(1, 3))):
        candidates = list(paths(body))
        if not candidates:
            break
        path = draw(st.sampled_from(candidates))
        how = draw(st.sampled_from(["replace", "hostile", "delete", "deep", "bad_field"]))
        if how == "delete":
            body = delete_path(body, path)
        elif how == "deep":
            body = set_path(body, path, DEEP_MARK)
        elif how == "bad_field":
            field_path, values = draw(st.sampled_from([e for e in BAD_FIELDS[route] if applicable(body, e[0])]))
            body = set_path(body, field_path, draw(st.sampled_from(values)))
        else:
            value = draw(json_values) if how == "replace" else draw(st.sampled_from(HOSTILE_VALUES))
            body = set_path(body, path, value)
    return route, encode(body)


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])


@PROPERTY
@given(route=st.sampled_from(ROUTES), value=json_values)
def test_property_arbitrary_json_is_answered_in_shape(
    http: httpx.Client, own_simulator: OwnSimulator, route: str, value: Any
) -> None:
    response, received = post(http, own_simulator, route, json.dumps(value).encode())
    assert_acceptable(route, response, received)


@PROPERTY
@given(case=mutated_bodies())
def test_property_mutated_real_bodies_are_answered_in_shape(
    http: httpx.Client, own_simulator: OwnSimulator, case: tuple[str, bytes]
) -> None:
    route, body = case
    response, received = post(http, own_simulator, route, body)
    assert_acceptable(route, response, received)
