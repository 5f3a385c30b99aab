"""Stream fidelity, round 2: the pure pieces (``<think>`` splitter, signature ids, 200
bodies that are no stream, settings) and the cross-turn and cross-room rules the
matrix (tests/generation/test_integrity.py) cannot show in one request."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.generation.policy import StreamPolicy
from gateway.protocols.envelope import PROCESS_KEYRING, Tenant
from gateway.protocols.tokens import count_chat_tokens, count_text
from gateway.redact import SECRETS
from gateway.settings import Settings, SettingsError
from gateway.simulator.quirks import THOUGHT_SIGNATURE
from gateway.simulator.reply import TEXT
from gateway.stream.accumulator import ChatSSEAccumulator
from gateway.stream.signatures import client_call_id, restore_thought_signatures, split_call_id
from gateway.stream.think_tags import ThinkTagSplitter
from gateway.upstream.config_file import model_reasoning_tags
from gateway.upstream.failures import answer_not_streamed, upstream_message
from gateway.upstream.json_answers import completion_as_chunks
from tests.conftest import Gateway, Simulator
from tests.drivers import DRIVERS, PROMPT, TOOLS


def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


# -- the <think> splitter ----------------------------------------------------------------


def split_all(pieces: list[str], starts: str = "auto") -> list[tuple[str, str]]:
    splitter = ThinkTagSplitter(starts)  # type: ignore[arg-type]
    out: list[tuple[str, str]] = []
    for piece in pieces:
        out += splitter.feed(piece)
    out += splitter.finish()
    merged: list[tuple[str, str]] = []
    for kind, text in out:
        if merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + text)
        else:
            merged.append((kind, text))
    return merged


@pytest.mark.parametrize(
    ("text", "starts", "expected"),
    [
        ("<think>plan</think>answer", "auto", [("reasoning", "plan"), ("text", "answer")]),
        ("plan</think>answer", "auto", [("reasoning", "plan"), ("text", "answer")]),  # closing tag, no opener
        ("just an answer, 1 < 2", "auto", [("text", "just an answer, 1 < 2")]),
        ("a<think>b</think>c<think>d</think>e", "auto",
         [("text", "a"), ("reasoning", "b"), ("text", "c"), ("reasoning", "d"), ("text", "e")]),
        ("plan</think>answer", "open", [("reasoning", "plan"), ("text", "answer")]),
        ("<think>plan</think>answer", "open", [("reasoning", "plan"), ("text", "answer")]),
        ("<think>unfinished", "auto", [("reasoning", "unfinished")]),
        ("answer with </think> stray", "open", [("reasoning", "answer with "), ("text", " stray")]),
    ],
)
def test_think_splitter_cases(text: str, starts: str, expected: list[tuple[str, str]]) -> None:
    assert split_all([text], starts) == expected


@given(st.sampled_from(["<think>plan</think>answer", "plan</think>answer", "x<think>y</think>z<", "no tags <thi"]),
       st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=10))
def test_think_splitter_is_independent_of_where_chunks_are_cut(text: str, cuts: list[int]) -> None:
    pieces, at = [], 0
    for size in cuts:
        pieces.append(text[at : at + size])
        at += size
    pieces.append(text[at:])
    assert split_all([p for p in pieces if p]) == split_all([text])


def test_think_splitter_auto_holds_only_until_the_first_tag() -> None:
    splitter = ThinkTagSplitter("auto")
    assert splitter.feed("still deciding") == []
    assert splitter.feed("</think>now") == [("reasoning", "still deciding"), ("text", "now")]
    assert splitter.feed(" streaming") == [("text", " streaming")]  # decided: no more holding


def test_think_splitter_open_streams_reasoning_at_once() -> None:
    splitter = ThinkTagSplitter("open")
    assert splitter.feed("thinking") == [("reasoning", "thinking")]
    assert splitter.feed(" on</th") == [("reasoning", " on")]  # the possible tag is held
    assert splitter.feed("ink>done") == [("text", "done")]


def test_accumulator_splits_only_when_opted_in() -> None:
    chunks = [chunk({"content": "<thi"}), chunk({"content": "nk>r</think>t"}), chunk({}, "stop")]
    plain, split = ChatSSEAccumulator(), ChatSSEAccumulator(reasoning_tags="auto")
    for c in chunks:
        plain.feed(c)
        split.feed(c)
    assert plain.seal().text == "<think>r</think>t"
    done = split.seal()
    assert (done.reasoning, done.text) == ("r", "t")


# -- accumulator normalisation -------------------------------------------------------------


def test_usage_last_total_wins_wherever_it_is() -> None:
    acc = ChatSSEAccumulator()
    acc.feed(chunk({"content": "a"}, usage={"prompt_tokens": 1, "completion_tokens": 1}))
    acc.feed(chunk({"content": "b"}, x_groq={"usage": {"prompt_tokens": 2, "completion_tokens": 2}}))
    acc.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                           "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}]})
    usage = acc.seal().usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 4, 7)


def test_object_arguments_repeated_are_one_call() -> None:
    acc = ChatSSEAccumulator()
    call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": {"x": 1}}}
    acc.feed(chunk({"tool_calls": [call]}))
    acc.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": {"x": 1}}}]}))
    acc.feed(chunk({}, "tool_calls"))
    assert [c.arguments for c in acc.seal().tool_calls] == ['{"x":1}']


def test_null_delta_and_null_index_are_absent_fields() -> None:
    acc = ChatSSEAccumulator()
    acc.feed({"choices": [{"index": None, "delta": None, "finish_reason": None, "logprobs": None}], "usage": None})
    acc.feed({"choices": [{"index": None, "delta": {"content": "ok", "tool_calls": None, "function_call": None},
                           "finish_reason": "stop"}]})
    assert acc.seal().text == "ok"


def test_finish_reason_error_fails_at_once() -> None:
    acc = ChatSSEAccumulator()
    with pytest.raises(GatewayError) as caught:
        acc.feed(chunk({"content": "partial"}, "error"))
    assert caught.value.code == "upstream_error"


def test_empty_finish_reason_without_done_is_incomplete() -> None:
    acc = ChatSSEAccumulator()
    acc.feed(chunk({"content": "a"}, ""))
    with pytest.raises(GatewayError, match="without a finish_reason"):
        acc.seal()


# -- 200 bodies that are no stream -----------------------------------------------------------


def test_200_bodies_name_what_the_upstream_said() -> None:
    with pytest.raises(GatewayError) as caught:
        answer_not_streamed(b"  ")
    assert caught.value.code == "upstream_empty_response"
    with pytest.raises(GatewayError) as caught:
        answer_not_streamed(b'{"error": "tool_choice not supported"}')
    assert caught.value.message.endswith("tool_choice not supported")
    answer = {"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}
    assert answer_not_streamed(json.dumps(answer).encode()) == answer  # stream: true ignored


def test_200_error_bodies_pass_the_redaction_point() -> None:
    SECRETS.set("test_fidelity", ["sk-proj-abcdef123456"])
    try:
        with pytest.raises(GatewayError) as caught:
            answer_not_streamed(b'{"error": {"message": "Incorrect API key provided: sk-proj-abcdef123456"}}')
    finally:
        SECRETS.drop("test_fidelity")
    assert caught.value.message.endswith("Incorrect API key provided: [redacted]")
    html = upstream_message(b"<html><body><script>x()</script><p>Bad   gateway</p></body></html>")
    assert html == "an HTML page: Bad gateway"


# -- Gemini thought signatures ---------------------------------------------------------------


def test_signature_ids_round_trip() -> None:
    """The signature is sealed into the id for one client and one call: it opens for them
    only; any other suffix is stripped (the upstream never gets client text as a signature)."""
    alice = Tenant("client:aaaaaaaaaaaaaaaa", lambda: PROCESS_KEYRING)
    bob = Tenant("client:bbbbbbbbbbbbbbbb", lambda: PROCESS_KEYRING)
    shown = client_call_id("call_1", "a+b/c==", alice.seal_signature)
    assert shown.startswith("call_1__gts_") and all(c.isalnum() or c in "_-" for c in shown)
    assert "a+b/c" not in shown and split_call_id(shown)[0] == "call_1"
    assert split_call_id("call_plain") == ("call_plain", None)
    assert client_call_id("call_1", "sig", None) == "call_1"  # no sealer: not carried

    def body(call_id: str) -> dict[str, Any]:
        return {"messages": [
            {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "x"},
        ]}

    restored = restore_thought_signatures(body(shown), alice.open_signature)
    call = restored["messages"][0]["tool_calls"][0]
    assert call["id"] == "call_1" and call["extra_content"] == {"google": {"thought_signature": "a+b/c=="}}
    assert restored["messages"][1]["tool_call_id"] == "call_1"
    token = split_call_id(shown)[1]
    forged = "call_1__gts_" + base64.urlsafe_b64encode(b"client text").decode().rstrip("=")
    for other, opener in ((shown, bob.open_signature), ("call_2__gts_" + token, alice.open_signature),
                          (forged, alice.open_signature), (shown[:-4], alice.open_signature)):
        stripped = restore_thought_signatures(body(other), opener)
        call = stripped["messages"][0]["tool_calls"][0]
        assert call["id"] == other.partition("__gts_")[0] and "extra_content" not in call
    untouched = {"messages": [{"role": "user", "content": "hi"}]}
    assert restore_thought_signatures(untouched, alice.open_signature) is untouched


def _second_turn(protocol: str, gateway: Gateway, ids: list[str], names: list[str]) -> None:
    """Send the calls back with their results, the way each protocol's clients do."""
    model = "echo"
    if protocol == "chat":
        client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
        client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": "{}"}} for i, n in zip(ids, names)]},
            *({"role": "tool", "tool_call_id": i, "content": "sunny"} for i in ids),
        ])
    elif protocol == "messages":
        client = anthropic.Anthropic(base_url=gateway.url, api_key="k", _strict_response_validation=True, max_retries=0)
        client.messages.create(model=model, max_tokens=64, messages=[
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": n, "input": {}} for i, n in zip(ids, names)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "sunny"} for i in ids]},
        ], tools=[{"name": t["name"], "input_schema": t["schema"]} for t in TOOLS])
    else:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
        client.responses.create(model=model, store=False, input=[
            {"type": "message", "role": "user", "content": PROMPT},
            *({"type": "function_call", "call_id": i, "name": n, "arguments": "{}"} for i, n in zip(ids, names)),
            *({"type": "function_call_output", "call_id": i, "output": "sunny"} for i in ids),
        ], tools=[{"type": "function", "name": t["name"], "parameters": t["schema"], "strict": False} for t in TOOLS])


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_gemini_signature_goes_back_with_its_call(gateway: Gateway, simulator: Simulator, protocol: str) -> None:
    outcome = DRIVERS[protocol](gateway.url, "gemini_signature;chunk=6")
    assert outcome.ok, outcome.error
    assert outcome.tool_ids[0].startswith("call_sim_0__gts_") and outcome.tool_ids[1] == "call_sim_1"
    assert THOUGHT_SIGNATURE.rstrip("=") not in outcome.tool_ids[0]  # sealed, not readable
    simulator.clear()
    _second_turn(protocol, gateway, outcome.tool_ids, [name for name, _ in outcome.tools])
    sent = simulator.requests()[-1]["body"]["messages"]
    calls = [c for m in sent if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    assert [c["id"] for c in calls] == ["call_sim_0", "call_sim_1"]
    assert calls[0]["extra_content"] == {"google": {"thought_signature": THOUGHT_SIGNATURE}}
    assert "extra_content" not in calls[1]
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == ["call_sim_0", "call_sim_1"]


# -- what the gateway sends upstream, and JSON answers in the legacy shape ---------------------


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_the_upstream_request_is_declared_json(gateway: Gateway, simulator: Simulator, protocol: str) -> None:
    """FastAPI servers (llama-cpp-python) parse a body only when it says it is JSON."""
    simulator.clear()
    assert DRIVERS[protocol](gateway.url, "text").ok
    assert simulator.requests()[-1]["headers"]["content-type"] == "application/json"


def _buffered_calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, **message},
                           "finish_reason": "tool_calls"}]}
    acc = ChatSSEAccumulator()
    for chunk in completion_as_chunks(answer):
        acc.feed(chunk)
    acc.feed_done()
    return [(c.name, c.arguments) for c in acc.seal().tool_calls]


def test_a_json_answer_with_only_function_call_is_one_call() -> None:
    assert _buffered_calls({"function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}) == [
        ("get_weather", '{"city": "Paris"}')]


def test_a_json_answer_with_function_call_beside_tool_calls_is_the_tool_call() -> None:
    """llama-cpp-python (chatml-function-calling, tool_choice auto, not streamed) names the
    legacy copy ``get_weather:``: the tool_calls entry is the call, once."""
    calls = _buffered_calls({
        "tool_calls": [{"id": "call__0_get_weather_cmpl-1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{ "city": "Paris" }'}}],
        "function_call": {"name": "get_weather:", "arguments": '{ "city": "Paris" }'},
    })
    assert calls == [("get_weather", '{ "city": "Paris" }')]


# -- one usage rule when the upstream reports none -------------------------------------------


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_no_upstream_usage_is_estimated_alike_in_every_room(gateway: Gateway, simulator: Simulator, protocol: str) -> None:
    simulator.clear()
    outcome = DRIVERS[protocol](gateway.url, "text;usage=none;chunk=16")
    assert outcome.ok, outcome.error
    sent = simulator.requests()[-1]["body"]
    assert outcome.usage == (count_chat_tokens(sent), count_text(TEXT))


# -- settings ------------------------------------------------------------------------------


def test_reasoning_tags_from_flag_and_toml(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[models."qwen3*"]\nreasoning_tags = true\n[models."r1-*"]\nreasoning_tags = "open"\n'
                      '[models."plain"]\nreasoning_tags = false\n')
    assert model_reasoning_tags(config) == {"qwen3*": "auto", "r1-*": "open"}
    settings = Settings(config=config, reasoning_tags="minimax*=open, qwen3-coder*", data_dir=tmp_path)
    assert settings.reasoning_tags == {"minimax*": "open", "qwen3-coder*": "auto"}
    policy = StreamPolicy.snapshot(settings)
    assert [policy.reasoning_tags_for(m) for m in ("qwen3-32b", "r1-distill", "minimax-m2", "gpt-4o")] == [
        "auto", "open", "open", None]
    config.write_text('[models."x"]\nreasoning_tags = "sometimes"\n')
    with pytest.raises(SettingsError, match="reasoning_tags"):
        model_reasoning_tags(config)
    # the one TOML model validates [models] too: a typo is refused with its line
    config.write_text('[models."x"]\nreasoning_tag = true\n')
    with pytest.raises(SettingsError, match=r"gateway.toml:2: models.x.reasoning_tag: unknown key"):
        model_reasoning_tags(config)


@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_an_event_stream_without_data_is_an_empty_answer(gateway: Gateway, simulator: Simulator, protocol: str) -> None:
    model = simulator.script([{"_op": "raw", "data": ""}])  # headers, then only a blank event
    outcome = DRIVERS[protocol](gateway.url, model)
    assert not outcome.ok and "upstream_empty_response" in outcome.error
