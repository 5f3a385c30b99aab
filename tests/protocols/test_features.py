"""Request and answer features that must survive translation (issue #29): logprobs, usage
details, matched stop sequences, legacy ``functions``, structured outputs on Messages,
Responses ``text.verbosity``, and audio refused by name. Each test drives the official SDK
(strict validation) through the gateway, both stream modes, streamed and not, against a
scripted simulator answer, and asserts both what the upstream received and what the SDK
assembled."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pydantic
import pytest

from tests.conftest import Gateway, Simulator

USER = [{"role": "user", "content": "hi"}]


def chat_client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", _strict_response_validation=True, max_retries=0)


def messages_client(gateway: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", _strict_response_validation=True, max_retries=0)


def frame(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **choice}]}


def logprob(token: str, value: float) -> dict[str, Any]:
    # vLLM's shape: bytes and top_logprobs present; the gateway also fills them when absent
    return {"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": [
        {"token": token, "logprob": value, "bytes": list(token.encode())}]}


TOKENS = [("Hel", -0.1), ("lo", -0.25), (" world", -1.5)]


def logprob_script(simulator: Simulator) -> str:
    frames: list[dict[str, Any]] = [frame({"role": "assistant", "content": ""})]
    for token, value in TOKENS:
        frames.append(frame({"content": token}, logprobs={"content": [logprob(token, value)]}))
    frames.append(frame({}, "stop"))
    frames.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    return simulator.script(frames)


def last_request(simulator: Simulator) -> dict[str, Any]:
    return simulator.requests()[-1]["body"]


# -- logprobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_chat_logprobs_reach_the_client_as_the_upstream_sent_them(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    model = logprob_script(simulator)
    client = chat_client(gateway)
    ask = {"model": model, "messages": USER, "logprobs": True, "top_logprobs": 1}
    if stream:
        with client.chat.completions.stream(**ask) as events:
            deltas = [e for e in events if e.type == "logprobs.content.delta"]
            completion = events.get_final_completion()
        assert deltas, "no logprobs delta event"
    else:
        completion = client.chat.completions.create(**ask)
    sent = last_request(simulator)
    assert sent["logprobs"] is True and sent["top_logprobs"] == 1
    choice = completion.choices[0]
    assert choice.message.content == "Hello world"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [(t.token, t.logprob) for t in choice.logprobs.content] == TOKENS
    assert [t.top_logprobs[0].token for t in choice.logprobs.content] == [t for t, _ in TOKENS]


@pytest.mark.parametrize("stream", [True, False])
def test_chat_logprobs_the_client_did_not_ask_for_stay_out(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    """A gateway that asks for logprobs itself (training capture) must not show them."""
    model = logprob_script(simulator)
    client = chat_client(gateway)
    if stream:
        with client.chat.completions.stream(model=model, messages=USER) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(model=model, messages=USER)
    assert completion.choices[0].message.content == "Hello world"
    assert completion.choices[0].logprobs is None


# -- usage details ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_chat_usage_details_are_relayed_whole(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18,
             "completion_tokens_details": {"reasoning_tokens": 2, "accepted_prediction_tokens": 3,
                                           "rejected_prediction_tokens": 1, "audio_tokens": 0},
             "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0}}
    model = simulator.script([frame({"role": "assistant", "content": "ok"}), frame({}, "stop"),
                              {"choices": [], "usage": usage}])
    client = chat_client(gateway)
    if stream:
        with client.chat.completions.stream(model=model, messages=USER, stream_options={"include_usage": True}) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(model=model, messages=USER)
    got = completion.usage
    assert got is not None and (got.prompt_tokens, got.completion_tokens, got.total_tokens) == (11, 7, 18)
    details = got.completion_tokens_details
    assert details is not None
    assert (details.reasoning_tokens, details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (2, 3, 1)
    assert got.prompt_tokens_details is not None and got.prompt_tokens_details.cached_tokens == 4


# -- matched stop sequences (Messages) ------------------------------------------------------------


@pytest.mark.parametrize("field", ["stop_reason", "matched_stop"])  # vLLM, SGLang
@pytest.mark.parametrize("stream", [True, False])
def test_messages_names_the_stop_sequence_that_matched(gateway: Gateway, simulator: Simulator, stream: bool, field: str) -> None:
    model = simulator.script([frame({"role": "assistant", "content": "one, two"}), frame({}, "stop", **{field: "THREE"})])
    client = messages_client(gateway)
    ask: dict[str, Any] = {"model": model, "max_tokens": 64, "messages": USER, "stop_sequences": ["FOUR", "THREE"]}
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**ask)
    assert last_request(simulator)["stop"] == ["FOUR", "THREE"]
    assert message.content[0].type == "text" and message.content[0].text == "one, two"
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "THREE")


@pytest.mark.parametrize("stream", [True, False])
def test_messages_a_stop_token_is_an_ordinary_end_turn(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    """vLLM's ``stop_reason`` is an integer for a stop *token*; a string the client never
    asked for is no stop sequence of theirs either."""
    for reason in (128009, "<|im_end|>"):
        model = simulator.script([frame({"role": "assistant", "content": "done"}), frame({}, "stop", stop_reason=reason)])
        client = messages_client(gateway)
        ask: dict[str, Any] = {"model": model, "max_tokens": 64, "messages": USER, "stop_sequences": ["END"]}
        if stream:
            with client.messages.stream(**ask) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**ask)
        assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)


# -- legacy functions ------------------------------------------------------------------------------

FUNCTIONS = [{"name": "get_weather", "description": "weather for a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.mark.parametrize("upstream_shape", ["tool_calls", "function_call"])
@pytest.mark.parametrize("stream", [True, False])
def test_legacy_functions_get_a_legacy_function_call(gateway: Gateway, simulator: Simulator, stream: bool, upstream_shape: str) -> None:
    if upstream_shape == "tool_calls":
        frames = [
            frame({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                       "function": {"name": "get_weather", "arguments": '{"city":'}}]}),
            frame({"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}),
            frame({}, "tool_calls"),
        ]
    else:
        frames = [
            frame({"role": "assistant", "function_call": {"name": "get_weather", "arguments": '{"city":'}}),
            frame({"function_call": {"arguments": ' "Paris"}'}}),
            frame({}, "function_call"),
        ]
    model = simulator.script(frames)
    client = chat_client(gateway)
    ask: dict[str, Any] = {"model": model, "messages": USER, "functions": FUNCTIONS, "function_call": {"name": "get_weather"}}
    if stream:
        with client.chat.completions.stream(**ask) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(**ask)
    sent = last_request(simulator)
    assert "functions" not in sent and "function_call" not in sent
    assert sent["tools"] == [{"type": "function", "function": FUNCTIONS[0]}]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    choice = completion.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None
    assert choice.message.function_call is not None
    assert choice.message.function_call.name == "get_weather"
    assert json.loads(choice.message.function_call.arguments) == {"city": "Paris"}


def test_tools_and_functions_together_are_refused(gateway: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    tools = [{"type": "function", "function": FUNCTIONS[0]}]
    answer = httpx.post(gateway.base_url + "/chat/completions",
                        json={"model": "echo", "messages": USER, "functions": FUNCTIONS, "tools": tools})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "functions"
    assert simulator.requests() == []


# -- audio --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
    {"audio": {"voice": "alloy", "format": "wav"}},
])
def test_audio_output_is_refused_by_name_before_the_upstream(gateway: Gateway, simulator: Simulator, body: dict[str, Any]) -> None:
    simulator.clear()
    with pytest.raises(openai.BadRequestError) as refused:
        chat_client(gateway).chat.completions.create(model="echo", messages=USER, **body)  # type: ignore[call-overload]
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "audio_not_supported"
    assert error["param"] in ("modalities", "audio")
    assert simulator.requests() == []


# -- structured outputs on Messages, Responses verbosity ------------------------------------------


class City(pydantic.BaseModel):
    city: str
    population: int


@pytest.mark.parametrize("stream", [True, False])
def test_messages_parse_sends_a_response_format_and_parses_the_answer(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    model = simulator.script([frame({"role": "assistant", "content": '{"city": "Paris", '}),
                              frame({"content": '"population": 2100000}'}), frame({}, "stop")])
    client = messages_client(gateway)
    ask: dict[str, Any] = {"model": model, "max_tokens": 64, "messages": USER, "output_format": City}
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
        parsed = City.model_validate_json(message.content[0].text)  # type: ignore[union-attr]
    else:
        parsed = client.messages.parse(**ask).parsed_output
    assert parsed == City(city="Paris", population=2100000)
    fmt = last_request(simulator)["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert set(fmt["json_schema"]["schema"]["properties"]) == {"city", "population"}


def test_messages_tool_strict_and_a_bad_format_are_handled(gateway: Gateway, simulator: Simulator) -> None:
    client = messages_client(gateway)
    tool = {"name": "get_weather", "input_schema": FUNCTIONS[0]["parameters"], "strict": True}
    client.messages.create(model="echo", max_tokens=32, messages=USER, tools=[tool])  # type: ignore[list-item]
    assert last_request(simulator)["tools"][0]["function"]["strict"] is True
    simulator.clear()
    refused = httpx.post(gateway.url + "/v1/messages", json={
        "model": "echo", "max_tokens": 32, "messages": USER, "output_config": {"format": {"type": "xml"}}})
    assert refused.status_code == 400
    assert refused.json()["type"] == "error" and "output_config.format.type" in refused.json()["error"]["message"]
    assert simulator.requests() == []


def test_responses_text_verbosity_reaches_the_upstream(gateway: Gateway, simulator: Simulator) -> None:
    client = chat_client(gateway)
    answer = client.responses.create(model="echo", input="hi", text={"verbosity": "low"})
    assert answer.output_text
    assert last_request(simulator)["verbosity"] == "low"
    simulator.clear()
    client.responses.create(model="echo", input="hi", text={"verbosity": "medium"})  # Codex's default
    assert "verbosity" not in last_request(simulator)  # the default: upstreams without the key still answer
    simulator.clear()
    refused = httpx.post(gateway.base_url + "/responses", json={"model": "echo", "input": "hi", "text": {"verbosity": "loud"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "text.verbosity"
    background = httpx.post(gateway.base_url + "/responses", json={"model": "echo", "input": "hi", "background": True})
    assert background.status_code == 400 and background.json()["error"]["code"] == "background_not_supported"
    assert simulator.requests() == []


# -- refusals -----------------------------------------------------------------------------------------

REFUSAL = "I can't help with that."


def refusal_script(simulator: Simulator) -> str:
    return simulator.script([frame({"role": "assistant", "refusal": "I can't "}), frame({"refusal": "help with that."}),
                             frame({}, "stop")])


@pytest.mark.parametrize("stream", [True, False])
def test_chat_parse_reports_a_refusal(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    model = refusal_script(simulator)
    client = chat_client(gateway)
    if stream:
        with client.chat.completions.stream(model=model, messages=USER, response_format=City) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.parse(model=model, messages=USER, response_format=City)
    message = completion.choices[0].message
    assert message.refusal == REFUSAL
    assert not message.content and message.parsed is None  # a stream opens with content ""
    assert completion.choices[0].finish_reason == "stop"
    assert last_request(simulator)["response_format"]["type"] == "json_schema"


@pytest.mark.parametrize("stream", [True, False])
def test_responses_parse_reports_a_refusal(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    model = refusal_script(simulator)
    client = chat_client(gateway)
    if stream:
        with client.responses.stream(model=model, input="hi", text_format=City) as events:
            kinds = [e.type for e in events]
            response = events.get_final_response()
        assert "response.refusal.delta" in kinds and "response.refusal.done" in kinds
        assert "response.output_text.delta" not in kinds
    else:
        response = client.responses.parse(model=model, input="hi", text_format=City)
    [message] = [item for item in response.output if item.type == "message"]
    [part] = message.content
    assert part.type == "refusal" and part.refusal == REFUSAL
    assert response.output_parsed is None


@pytest.mark.parametrize("stream", [True, False])
def test_messages_says_refusal_as_its_stop_reason(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    model = refusal_script(simulator)
    client = messages_client(gateway)
    ask: dict[str, Any] = {"model": model, "max_tokens": 64, "messages": USER}
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**ask)
    assert message.stop_reason == "refusal"
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", REFUSAL)]


@pytest.mark.parametrize("stream", [True, False])
def test_responses_output_text_logprobs_when_included(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    model = logprob_script(simulator)
    client = chat_client(gateway)
    ask: dict[str, Any] = {"model": model, "input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    if stream:
        with client.responses.stream(**ask) as events:
            deltas = [e for e in events if e.type == "response.output_text.delta"]
            response = events.get_final_response()
        assert [(lp.token, lp.logprob) for d in deltas for lp in d.logprobs or []] == TOKENS
    else:
        response = client.responses.create(**ask)
    sent = last_request(simulator)
    assert sent["logprobs"] is True and sent["top_logprobs"] == 1
    [message] = [item for item in response.output if item.type == "message"]
    [part] = message.content
    assert part.type == "output_text" and part.text == "Hello world"
    assert [(lp.token, lp.logprob, lp.bytes) for lp in part.logprobs or []] == [(t, v, list(t.encode())) for t, v in TOKENS]
    assert [lp.top_logprobs[0].token for lp in part.logprobs or []] == [t for t, _ in TOKENS]


def test_responses_logprobs_not_included_stay_out(gateway: Gateway, simulator: Simulator) -> None:
    model = logprob_script(simulator)
    with chat_client(gateway).responses.stream(model=model, input="hi") as events:
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        response = events.get_final_response()
    assert "logprobs" not in last_request(simulator)
    assert all(not d.logprobs for d in deltas)
    [message] = [item for item in response.output if item.type == "message"]
    assert message.content[0].type == "output_text" and message.content[0].logprobs == []


# -- the field tables in docs/protocols/*.md --------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocols"


def documented(doc: str, section: str) -> set[str]:
    """The top-level field names in the first column of ``section``'s tables (a row's
    backticked names: ``a.b`` counts as ``a``, ``a[].b`` as ``a``)."""
    text = (DOCS / doc).read_text()
    start = next(i for i, line in enumerate(text.splitlines()) if line.startswith("#") and section in line)
    names: set[str] = set()
    for line in text.splitlines()[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("| `"):
            first = line.split(" | ")[0]
            names |= {re.split(r"[.\[ (]", n)[0] for n in re.findall(r"`([^`]+)`", first)}
    return names


def request_fields(params: type) -> set[str]:
    return {key for cls in params.__mro__ for key in getattr(cls, "__annotations__", {})}


def model_fields(*models: type[pydantic.BaseModel]) -> set[str]:
    return {name for model in models for name in model.model_fields}


@pytest.mark.parametrize(("doc", "section", "fields"), [
    ("chat.md", "Request", lambda: request_fields(openai.types.chat.completion_create_params.CompletionCreateParamsBase) | {"stream"}),
    ("responses.md", "Request keys", lambda: request_fields(openai.types.responses.response_create_params.ResponseCreateParamsBase) | {"stream"}),
    ("messages.md", "Request translation", lambda: request_fields(anthropic.types.message_create_params.MessageCreateParamsBase) | {"stream"}),
    ("chat.md", "Answer fields", lambda: model_fields(openai.types.chat.ChatCompletion)),
    ("responses.md", "Answer fields", lambda: model_fields(openai.types.responses.Response)),
    ("messages.md", "Answer fields", lambda: model_fields(anthropic.types.Message)),
])
def test_every_sdk_field_has_a_row_in_the_protocol_tables(doc: str, section: str, fields: Any) -> None:
    """A field the SDKs learn (a new release) fails here until its row says what the
    gateway does with it: translated, forwarded, refused (code) or ignored (why)."""
    missing = sorted(fields() - documented(doc, section))
    assert not missing, f"docs/protocols/{doc} ({section}) has no row for {missing}"


CACHE_USAGE = {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
               "prompt_tokens_details": {"cached_tokens": 60, "cache_write_tokens": 30},
               "completion_tokens_details": {"reasoning_tokens": 2}}


@pytest.mark.parametrize("stream", [True, False])
def test_cache_reads_and_writes_reach_messages_and_responses_usage(gateway: Gateway, simulator: Simulator, stream: bool) -> None:
    model = simulator.script([frame({"role": "assistant", "content": "ok"}), frame({}, "stop"),
                              {"choices": [], "usage": CACHE_USAGE}])
    ask: dict[str, Any] = {"model": model, "max_tokens": 16, "messages": USER}
    anthropic_client = messages_client(gateway)
    if stream:
        with anthropic_client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = anthropic_client.messages.create(**ask)
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (10, 60, 30)
    assert usage.output_tokens == 5
    openai_client = chat_client(gateway)
    if stream:
        with openai_client.responses.stream(model=model, input="hi") as events:
            response = events.get_final_response()
    else:
        response = openai_client.responses.create(model=model, input="hi")
    assert response.usage is not None
    details = response.usage.input_tokens_details
    assert (response.usage.input_tokens, details.cached_tokens, details.cache_write_tokens) == (100, 60, 30)
    assert response.usage.output_tokens_details.reasoning_tokens == 2
