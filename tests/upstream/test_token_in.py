"""Token-in continuation (issue #27, docs/capture.md): the pure parts fed directly (the
Hermes parser, the continuation decision and splice, the engine-stream converter, the
simulator's vLLM emulation), then rollouts end to end through the official SDKs against
the simulator's vLLM token-in, in both stream modes."""

from __future__ import annotations

import json
import secrets
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.rollout.chain import TokenInPlan, continuation, splice
from gateway.simulator import token_in as sim_token_in
from gateway.simulator import tokens as sim_tokens
from gateway.upstream.hermes import HermesParser
from gateway.upstream.token_in import EngineStream, engine_body
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway

# -- the Hermes parser ----------------------------------------------------------------------


def parse(pieces: list[str]) -> list[dict[str, Any]]:
    parser = HermesParser()
    out = [d for p in pieces for d in parser.feed(p)]
    return out + parser.finish()


def test_text_and_two_calls_split_anywhere_become_one_delta_each() -> None:
    raw = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>')
    for size in (1, 3, 7, len(raw)):
        out = parse([raw[i : i + size] for i in range(0, len(raw), size)])
        text = "".join(d.get("content", "") for d in out)
        calls = [c for d in out for c in d.get("tool_calls", [])]
        assert text == "Let me look. "
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (0, "get_weather", {"city": "Paris"}), (1, "get_time", {"timezone": "UTC"})]
        assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


def test_text_that_only_looks_like_a_tag_is_text_and_think_tags_stay_in_content() -> None:
    out = parse(["<think>hm</think>a <tool", " b < c <tool_cal"])
    assert out and all("tool_calls" not in d for d in out)
    assert "".join(d["content"] for d in out) == "<think>hm</think>a <tool b < c <tool_cal"


def test_unreadable_call_json_keeps_its_raw_arguments_for_repair_and_a_nameless_one_is_text() -> None:
    out = parse(['<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'])
    assert out == [{"tool_calls": [{**out[0]["tool_calls"][0], "function": {"name": "f", "arguments": '{"a": 1,}'}}]}]
    assert parse(["<tool_call>nonsense</tool_call>"]) == [{"content": "<tool_call>nonsense</tool_call>"}]


def test_a_call_cut_by_the_length_limit_is_text_unless_its_json_is_whole() -> None:
    assert parse(['<tool_call>\n{"name": "f", "argu']) == [{"content": '<tool_call>\n{"name": "f", "argu'}]
    [delta] = parse(['<tool_call>\n{"name": "f", "arguments": {}}\n'])
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


# -- the decision (gateway/rollout/chain.py) ------------------------------------------------

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "weather?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def record(call_id: str, messages: list[dict[str, Any]], answer: dict[str, Any], prompt: list[int],
           completion: list[int], started: float, outcome: str = "success") -> dict[str, Any]:
    return {"call_id": call_id, "started_at": started, "outcome": outcome,
            "upstream_request": {"messages": messages, "tools": TOOLS},
            "answer": {"text": "", "tool_calls": [], **answer},
            "tokens": {"prompt_ids": prompt, "completion_ids": completion, "completion_logprobs": [-0.1] * len(completion)}}


FIRST = record("c1", [SYSTEM, USER], {"tool_calls": [CALL]}, [1, 2, 3], [7, 8, 9], 1.0)
ASSISTANT = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "toolu_x", "type": "function", "function": {"name": "get_weather", "arguments": '{ "city":"Paris" }'}}]}
RESULT = {"role": "tool", "tool_call_id": "toolu_x", "content": "18 C"}


def test_an_extension_is_used_whatever_ids_and_spacing_the_client_kept() -> None:
    plan = continuation([FIRST], {"messages": [SYSTEM, USER, ASSISTANT, RESULT], "tools": TOOLS})
    assert plan.status == "used" and plan.previous_call_id == "c1"
    assert plan.prefix_ids == (1, 2, 3, 7, 8, 9) and plan.previous_prompt == (1, 2, 3)
    assert plan.render_messages == (SYSTEM, USER, {"role": "assistant", "content": ""}, RESULT)


@pytest.mark.parametrize(("messages", "tools", "reason"), [
    ([USER, ASSISTANT, RESULT], TOOLS, "system_changed"),
    ([{**SYSTEM, "content": "other"}, USER, ASSISTANT, RESULT], TOOLS, "system_changed"),
    ([SYSTEM, USER, ASSISTANT, RESULT], None, "tools_changed"),
    ([SYSTEM, {"role": "user", "content": "edited"}, ASSISTANT, RESULT], TOOLS, "history_edited"),
    ([SYSTEM, {"role": "user", "content": "summary of it all"}], TOOLS, "history_edited"),
    ([SYSTEM], TOOLS, "history_truncated"),
    ([SYSTEM, USER, {**ASSISTANT, "tool_calls": [{"function": {"name": "get_weather", "arguments": "{}"}}]}, RESULT],
     TOOLS, "answer_changed"),
    ([SYSTEM, USER, ASSISTANT], TOOLS, "no_new_messages"),
    ([SYSTEM, USER, ASSISTANT, RESULT, {"role": "assistant", "content": "<tool_call>"}], TOOLS, "prefill"),
])
def test_what_is_no_extension_says_why(messages: list[dict[str, Any]], tools: Any, reason: str) -> None:
    plan = continuation([FIRST], {"messages": messages, "tools": tools})
    assert plan.status == "skipped: " + reason and not plan.used and plan.previous_call_id == "c1"


def test_first_turn_failed_calls_and_side_calls() -> None:
    assert continuation([], {"messages": [USER]}).status == "skipped: first_turn"
    failed = {**FIRST, "outcome": "error"}
    assert continuation([failed], {"messages": [SYSTEM, USER, ASSISTANT, RESULT], "tools": TOOLS}).status == "skipped: first_turn"
    side = record("c2", [SYSTEM, {"role": "user", "content": "title?"}], {"text": "T"}, [1, 5], [6], 2.0)
    plan = continuation([FIRST, side], {"messages": [SYSTEM, USER, ASSISTANT, RESULT], "tools": TOOLS})
    assert plan.status == "used" and plan.previous_call_id == "c1"  # the side call does not break the chain


def test_splice_keeps_the_sampled_ids_and_does_not_repeat_a_sampled_end_of_turn() -> None:
    plan = TokenInPlan("used", "c1", (1, 2, 3, 7, 8, 99), (), (1, 2, 3))
    rendered = [1, 2, 3, 99, 10, 11, 12, 5]  # previous prompt, the empty turn's end (99), the new turn
    assert splice(plan, rendered, 99) == [1, 2, 3, 7, 8, 99, 10, 11, 12, 5]
    assert splice(plan, rendered, 8) == [1, 2, 3, 7, 8, 99, 99, 10, 11, 12, 5]  # no end sampled: the template's
    assert splice(plan, [1, 4, 3, 99], 99) == "template_not_append_only"


# -- the engine stream -> chat chunks ------------------------------------------------------


def test_vllm_completion_chunks_become_chat_chunks_with_ids_logprobs_and_a_tool_call() -> None:
    stream = EngineStream("vllm", [1, 2])
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    chunks = []
    for k in range(0, len(text), 10):
        piece = text[k : k + 10]
        chunks += stream.handle({"choices": [{"index": 0, "text": piece, "token_ids": [ord(c) for c in piece],
                                              "logprobs": {"tokens": list(piece), "token_logprobs": [-0.5] * len(piece)}}]})
    chunks += stream.handle({"choices": [{"index": 0, "text": "", "token_ids": [0], "finish_reason": "stop",
                                          "logprobs": {"tokens": [""], "token_logprobs": [-0.25]}}]})
    assert stream.finished and chunks[0]["prompt_token_ids"] == [1, 2] and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])]
    entries = [e for c in chunks for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content", [])]
    assert ids == [ord(c) for c in text] + [0] and [e["id"] for e in entries] == ids
    assert [e["logprob"] for e in entries] == [-0.5] * len(text) + [-0.25]
    calls = [t for c in chunks for ch in c["choices"] for t in (ch["delta"].get("tool_calls") or [])]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls] == [("f", '{"a": 1}')]
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["tool_calls"] and chunks[-1] == {"choices": [], "usage": {
        "prompt_tokens": 2, "completion_tokens": len(text) + 1, "total_tokens": len(text) + 3}}


def test_llamacpp_completion_chunks_and_its_length_stop() -> None:
    stream = EngineStream("llamacpp", [5])
    out = stream.handle({"content": "Hel", "tokens": [10], "stop": False,
                         "completion_probabilities": [{"id": 10, "token": "Hel", "logprob": -0.1, "top_logprobs": []}]})
    out += stream.handle({"content": "lo", "tokens": [11], "stop": True, "stop_type": "limit", "tokens_evaluated": 1,
                          "tokens_predicted": 2, "completion_probabilities": [{"id": 11, "token": "lo", "logprob": -0.2}]})
    text = "".join(ch["delta"].get("content") or "" for c in out for ch in c["choices"])
    assert text == "Hello"
    assert [e["id"] for c in out for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content", [])] == [10, 11]
    assert [ch["finish_reason"] for c in out for ch in c["choices"] if ch["finish_reason"]] == ["length"]
    assert out[-1]["usage"]["completion_tokens"] == 2


def test_engine_bodies_carry_the_sampling_fields() -> None:
    body = {"model": "m", "messages": [], "max_tokens": 64, "temperature": 0.3, "top_p": 0.9, "seed": 7,
            "stop": ["</s>"], "logprobs": True, "top_logprobs": 2, "tools": TOOLS}
    assert engine_body("vllm", body, [1, 2]) == {
        "prompt": [1, 2], "model": "m", "max_tokens": 64, "temperature": 0.3, "top_p": 0.9, "seed": 7,
        "stop": ["</s>"], "return_token_ids": True, "logprobs": 2}
    assert engine_body("vllm", {"model": "m", "messages": []}, [1])["max_tokens"] is None  # not the legacy 16
    assert engine_body("llamacpp", body, [1, 2]) == {
        "prompt": [1, 2], "n_predict": 64, "temperature": 0.3, "top_p": 0.9, "seed": 7, "stop": ["</s>"],
        "n_probs": 2, "return_tokens": True, "cache_prompt": True}


# -- the simulator's vLLM emulation --------------------------------------------------------


def test_the_simulators_tokenize_and_decode_are_the_chat_template() -> None:
    body = {"messages": [SYSTEM, USER, {"role": "assistant", "content": ""}, RESULT], "tools": TOOLS}
    ids = sim_token_in.tokenize({**body, "add_generation_prompt": True})["tokens"]
    assert ids == sim_tokens.prompt_ids(body)
    assert sim_token_in.tokenize({**body, "add_generation_prompt": False})["tokens"] == ids[:-1]
    decoded = sim_token_in.decode(ids)
    assert [m["role"] for m in decoded["messages"]] == ["system", "user", "assistant", "tool"]
    assert decoded["tools"] == [{"type": "function", "function": {"name": "get_weather"}}]
    chunks = sim_token_in.completion_chunks({"prompt": ids, "model": "text", "return_token_ids": True, "logprobs": 0,
                                             "max_tokens": 5, "stream_options": {"include_usage": True}}, "x", 0)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids and chunks[-1]["usage"]["completion_tokens"] == 5


# -- end to end (simulator's vLLM token-in) -------------------------------------------------

CLIENT_KEY = "ck-token-in-client-key-0123456789"
PLAN = 'CALL get_weather {"city": "Paris"} then CALL get_time {"timezone": "Europe/Paris"}'
MODES = ["compatible", "realtime"]
MESSAGES_TOOLS = [
    {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_time", "description": "Time", "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}}},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
              for t in MESSAGES_TOOLS]


@pytest.fixture(scope="module")
def token_in_gateways(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gateway]:
    return {mode: start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=mode, token_in="vllm",
                                api_key=[CLIENT_KEY]) for mode in MODES}


def read_back(gateway: Gateway, rollout: str, part: str = "") -> dict[str, Any]:
    response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}{part}", headers=gateway.admin, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def engine_requests(simulator: Simulator, nonce: str) -> list[dict[str, Any]]:
    """The generation requests of one conversation, in order: chat bodies carry the nonce
    as text, token-in prompts as character ids."""
    ids = sim_tokens.chars(nonce)

    def mine(r: dict[str, Any]) -> bool:
        if r["path"].endswith("/chat/completions"):
            return nonce in json.dumps(r["body"])
        prompt = r["body"].get("prompt") if r["path"].endswith("/v1/completions") else None
        return isinstance(prompt, list) and any(prompt[i : i + len(ids)] == ids for i in range(len(prompt)))

    return [r for r in simulator.requests() if mine(r)]


def audit_of(gateway: Gateway, request_id: str) -> dict[str, Any]:
    """The request's audit record, once the audit writer's batch is in (bounded wait)."""
    import time

    deadline = time.monotonic() + 10
    while True:
        response = httpx.get(f"{gateway.url}/admin/api/audit/{request_id}", headers=gateway.admin, timeout=10)
        if response.status_code == 200 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return response.json()  # type: ignore[no-any-return]
        time.sleep(0.05)


def check_token_in_rollout(gateway: Gateway, simulator: Simulator, rollout: str, nonce: str) -> None:
    calls = read_back(gateway, rollout)["calls"]
    requests = engine_requests(simulator, nonce)
    assert [r["path"] for r in requests] == ["/v1/chat/completions", "/v1/completions", "/v1/completions"]
    assert [c["token_in"]["status"] for c in calls] == ["skipped: first_turn", "used", "used"]
    assert [c["token_in"]["render_calls"] for c in calls] == [0, 1, 1]
    print("\nsimulator token-in render ms per turn:", [c["token_in"]["render_ms"] for c in calls[1:]])
    for n in (1, 2):
        before = calls[n - 1]["tokens"]
        sent = requests[n]["body"]["prompt"]
        # what the engine got starts with the previous call's prompt + completion, exactly
        assert sent[: len(before["prompt_ids"]) + len(before["completion_ids"])] == before["prompt_ids"] + before["completion_ids"]
        assert sent == calls[n]["tokens"]["prompt_ids"] and len(sent) > len(before["prompt_ids"]) + len(before["completion_ids"])
        assert calls[n]["token_in"]["previous_call_id"] == calls[n - 1]["call_id"]
        assert calls[n]["continuity"] == {"previous_call_id": calls[n - 1]["call_id"], "prefix": "exact", "diverged_at": None}
        body = requests[n]["body"]
        assert body["return_token_ids"] is True and body["stream"] is True and "messages" not in body
    assert [c["answer"]["finish_reason"] for c in calls] == ["tool_calls", "tool_calls", "stop"]
    assert [[t["name"] for t in c["answer"]["tool_calls"]] for c in calls] == [["get_weather"], ["get_time"], []]
    for call in calls:  # one audit record per request, token-in calls too
        assert audit_of(gateway, call["call_id"])["outcome"] == "success"
    [segment] = read_back(gateway, rollout, "/trajectory")["segments"]
    last = calls[-1]["tokens"]
    assert segment["call_ids"] == [c["call_id"] for c in calls]
    assert segment["tokens"] == last["prompt_ids"] + last["completion_ids"]
    assert sum(segment["mask"]) == sum(len(c["tokens"]["completion_ids"]) for c in calls)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("mode", MODES)
def test_chat_tool_turns_continue_as_token_ids(
    token_in_gateways: dict[str, Gateway], simulator: Simulator, mode: str, stream: bool
) -> None:
    gateway, rollout, nonce = token_in_gateways[mode], f"ti.{secrets.token_hex(4)}", secrets.token_hex(6)
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY,
                           _strict_response_validation=True, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {PLAN}"}]
    seen: list[list[tuple[str, Any]]] = []
    for _ in range(3):
        if stream:
            with client.chat.completions.stream(model="agent;chunk=7", messages=messages, tools=CHAT_TOOLS) as s:  # type: ignore[arg-type]
                for _event in s:
                    pass
                message = s.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(model="agent;chunk=7", messages=messages, tools=CHAT_TOOLS).choices[0].message  # type: ignore[arg-type]
        seen.append([(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []])
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
    assert seen == [[("get_weather", {"city": "Paris"})], [("get_time", {"timezone": "Europe/Paris"})], []]
    assert message.content == "Done. The tool said: get_time says 18 C"
    check_token_in_rollout(gateway, simulator, rollout, nonce)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("mode", MODES)
def test_messages_tool_turns_continue_as_token_ids(
    token_in_gateways: dict[str, Gateway], simulator: Simulator, mode: str, stream: bool
) -> None:
    gateway, rollout, nonce = token_in_gateways[mode], f"ti.{secrets.token_hex(4)}", secrets.token_hex(6)
    client = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key=CLIENT_KEY,
                                 _strict_response_validation=True, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {PLAN}"}]
    seen = []
    for _ in range(3):
        if stream:
            with client.messages.stream(model="agent;chunk=7", max_tokens=512, messages=messages, tools=MESSAGES_TOOLS) as s:  # type: ignore[arg-type]
                final = s.get_final_message()
        else:
            final = client.messages.create(model="agent;chunk=7", max_tokens=512, messages=messages, tools=MESSAGES_TOOLS)  # type: ignore[arg-type]
        uses = [b for b in final.content if b.type == "tool_use"]
        seen.append([(u.name, u.input) for u in uses])
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]})
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": f"{u.name} says 18 C"} for u in uses]})
    assert seen == [[("get_weather", {"city": "Paris"})], [("get_time", {"timezone": "Europe/Paris"})], []]
    assert final.stop_reason == "end_turn" and final.content[0].type == "text"
    assert final.content[0].text == "Done. The tool said: get_time says 18 C"
    check_token_in_rollout(gateway, simulator, rollout, nonce)


@pytest.mark.parametrize("mode", MODES)
def test_an_edited_or_compacted_history_goes_the_chat_way_and_says_why(
    token_in_gateways: dict[str, Gateway], simulator: Simulator, mode: str
) -> None:
    gateway, rollout, nonce = token_in_gateways[mode], f"ti.{secrets.token_hex(4)}", secrets.token_hex(6)
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY,
                           _strict_response_validation=True, max_retries=0)
    first = [{"role": "user", "content": f"{nonce}: {PLAN}"}]
    message = client.chat.completions.create(model="agent", messages=first, tools=CHAT_TOOLS).choices[0].message  # type: ignore[arg-type]
    [call] = message.tool_calls or []
    answer = [message.model_dump(exclude_none=True, exclude={"parsed"}),
              {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    edited = [{"role": "user", "content": f"{nonce}: {PLAN} (edited)"}, *answer]
    client.chat.completions.create(model="agent", messages=edited, tools=CHAT_TOOLS)  # type: ignore[arg-type]
    compacted = [{"role": "user", "content": f"{nonce}: a summary of what happened"}]
    client.chat.completions.create(model="agent", messages=compacted, tools=CHAT_TOOLS)  # type: ignore[arg-type]
    other_tools = [*first, *answer]
    client.chat.completions.create(model="agent", messages=other_tools, tools=CHAT_TOOLS[:1])  # type: ignore[arg-type]
    calls = read_back(gateway, rollout)["calls"]
    assert [c["token_in"]["status"] for c in calls] == [
        "skipped: first_turn", "skipped: history_edited", "skipped: history_truncated", "skipped: tools_changed"]
    assert [r["path"] for r in engine_requests(simulator, nonce)] == ["/v1/chat/completions"] * 4
    assert calls[1]["continuity"]["prefix"] == "diverged"


# -- the llama.cpp shell on httpx.MockTransport -------------------------------------------

LLAMA_PLAN_PROMPT = [1, 2, 3]


class FakeLlama:
    """/apply-template, /tokenize and a streamed /completion, logging every request."""

    def __init__(self, rendered: list[int], template_status: int = 200) -> None:
        self.rendered = rendered
        self.template_status = template_status
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.seen.append((request.url.path, body))
        if request.url.path == "/apply-template":
            return httpx.Response(self.template_status, json={"prompt": "PROMPT"})
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": self.rendered})
        if request.url.path == "/completion":
            frames = [{"content": '<tool_call>\n{"name": "get_weather", ', "tokens": [40, 41], "stop": False,
                       "completion_probabilities": [{"id": 40, "logprob": -0.1}, {"id": 41, "logprob": -0.2}]},
                      {"content": '"arguments": {"city": "Paris"}}\n</tool_call>', "tokens": [42], "stop": False,
                       "completion_probabilities": [{"id": 42, "logprob": -0.3}]},
                      {"content": "", "tokens": [], "stop": True, "stop_type": "eos", "tokens_evaluated": 9,
                       "tokens_predicted": 3}]
            sse = b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames)
            return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})
        chunk = {"choices": [{"index": 0, "delta": {"content": "chat"}, "finish_reason": "stop"}]}
        return httpx.Response(200, content=b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})


async def run_token_in(fake: FakeLlama, plan: TokenInPlan, body: dict[str, Any]) -> tuple[Any, list[Any]]:
    from gateway.generation.policy import StreamPolicy
    from gateway.settings import Settings
    from gateway.upstream.client import UpstreamClient
    from gateway.upstream.credential import Credential, Upstream
    from gateway.upstream.token_in import TokenIn

    client = UpstreamClient(http=httpx.AsyncClient(transport=httpx.MockTransport(fake)))
    token_in = TokenIn(plan, body, client)
    credential = Credential(Upstream("llama", "http://llama.test/v1", token_in="llamacpp"), None)
    policy = StreamPolicy.snapshot(Settings(upstream_url=["http://llama.test/v1"]))
    try:
        items = [i async for i in token_in.send(credential, body, policy)]
    finally:
        await client.aclose()
    return token_in, items


LLAMA_BODY = {"model": "m", "messages": [SYSTEM, USER, ASSISTANT, RESULT], "tools": TOOLS, "tool_choice": "required",
              "max_tokens": 32, "temperature": 0}
LLAMA_PLAN = TokenInPlan("used", "c1", (1, 2, 3, 7, 8), (SYSTEM, USER, {"role": "assistant", "content": ""}, RESULT), (1, 2, 3))


async def test_llamacpp_attempt_renders_splices_and_parses_the_engines_stream() -> None:
    fake = FakeLlama([1, 2, 3, 99, 10, 11])
    token_in, items = await run_token_in(fake, LLAMA_PLAN, LLAMA_BODY)
    assert [p for p, _ in fake.seen] == ["/apply-template", "/tokenize", "/completion"]
    assert fake.seen[0][1] == {"messages": list(LLAMA_PLAN.render_messages), "tools": TOOLS, "tool_choice": "required"}
    completion = fake.seen[2][1]
    assert completion["prompt"] == [1, 2, 3, 7, 8, 99, 10, 11] and completion["stream"] is True
    assert completion["n_predict"] == 32 and completion["grammar"].startswith("root ::= \"<tool_call>")
    assert token_in.status == "used" and token_in.prompt_ids == completion["prompt"] and token_in.render_calls == 2
    chunks = [i for i in items if isinstance(i, dict)]
    calls = [t for c in chunks for ch in c["choices"] for t in ch["delta"].get("tool_calls") or []]
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [("get_weather", {"city": "Paris"})]
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["tool_calls"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


@pytest.mark.parametrize(("fake", "plan", "status"), [
    (FakeLlama([1, 5, 3, 99]), LLAMA_PLAN, "skipped: template_not_append_only"),
    (FakeLlama([1], template_status=500), LLAMA_PLAN, "skipped: render_failed"),
    (FakeLlama([1]), TokenInPlan("skipped: history_edited", "c1"), "skipped: history_edited"),
])
async def test_llamacpp_attempt_falls_back_to_chat_and_says_why(fake: FakeLlama, plan: TokenInPlan, status: str) -> None:
    token_in, items = await run_token_in(fake, plan, LLAMA_BODY)
    assert token_in.status == status and token_in.prompt_ids is None
    assert fake.seen[-1][0] == "/v1/chat/completions" and not any(p == "/completion" for p, _ in fake.seen)
    assert [ch["delta"]["content"] for i in items if isinstance(i, dict) for ch in i["choices"]] == ["chat"]


async def test_a_regeneration_body_goes_the_chat_way() -> None:
    """Compatible mode's next body (a repair note appended) is not the planned one."""
    fake = FakeLlama([1, 2, 3, 99])
    regenerated = {**LLAMA_BODY, "messages": [*LLAMA_BODY["messages"], {"role": "user", "content": "fix it"}]}
    from gateway.generation.policy import StreamPolicy
    from gateway.settings import Settings
    from gateway.upstream.client import UpstreamClient
    from gateway.upstream.credential import Credential, Upstream
    from gateway.upstream.token_in import TokenIn

    client = UpstreamClient(http=httpx.AsyncClient(transport=httpx.MockTransport(fake)))
    token_in = TokenIn(LLAMA_PLAN, LLAMA_BODY, client)
    credential = Credential(Upstream("llama", "http://llama.test/v1", token_in="llamacpp"), None)
    policy = StreamPolicy.snapshot(Settings(upstream_url=["http://llama.test/v1"]))
    first = [i async for i in token_in.send(credential, LLAMA_BODY, policy)]
    assert token_in.status == "used" and [p for p, _ in fake.seen][-1] == "/completion" and first
    fake.seen.clear()
    [i async for i in token_in.send(credential, regenerated, policy)]
    await client.aclose()
    assert token_in.status == "skipped: regeneration" and [p for p, _ in fake.seen] == ["/v1/chat/completions"]


def test_a_required_call_is_a_grammar_of_the_declared_names_and_a_named_one_of_that_name() -> None:
    from gateway.upstream.token_in import required_call_grammar

    two = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    grammar = required_call_grammar({"tool_choice": "required", "tools": two})
    assert grammar is not None and 'name ::= "get_weather" | "get_time"' in grammar
    named = required_call_grammar({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "tools": two})
    assert named is not None and 'name ::= "get_time"\n' in named
    assert required_call_grammar({"tool_choice": "auto", "tools": two}) is None
    assert required_call_grammar({"tools": two}) is None


RESPONSES_TOOLS = [{"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"],
                    "strict": False} for t in MESSAGES_TOOLS]


@pytest.mark.parametrize("mode", MODES)
def test_responses_tool_turns_continue_as_token_ids(
    token_in_gateways: dict[str, Gateway], simulator: Simulator, mode: str
) -> None:
    gateway, rollout, nonce = token_in_gateways[mode], f"ti.{secrets.token_hex(4)}", secrets.token_hex(6)
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY,
                           _strict_response_validation=True, max_retries=0)
    items: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {PLAN}"}]
    seen = []
    for _ in range(3):
        with client.responses.stream(model="agent;chunk=7", input=items, tools=RESPONSES_TOOLS, store=False) as s:  # type: ignore[arg-type]
            response = s.get_final_response()
        output = [item.model_dump(exclude_none=True) for item in response.output]
        seen.append([(o["name"], json.loads(o["arguments"])) for o in output if o["type"] == "function_call"])
        for item in output:
            items.append({k: v for k, v in item.items() if k != "status" or item["type"] == "message"})
            if item["type"] == "function_call":
                items.append({"type": "function_call_output", "call_id": item["call_id"], "output": f"{item['name']} says 18 C"})
    assert seen == [[("get_weather", {"city": "Paris"})], [("get_time", {"timezone": "Europe/Paris"})], []]
    assert response.output_text == "Done. The tool said: get_time says 18 C"
    check_token_in_rollout(gateway, simulator, rollout, nonce)


def test_token_in_is_set_per_upstream_in_the_toml_and_by_the_flag(tmp_path: Any) -> None:
    from gateway.settings import Settings
    from gateway.upstream.config import build_pool

    config = tmp_path / "gw.toml"
    config.write_text('[[upstreams]]\nname = "engine"\nbase_url = "http://127.0.0.1:9/v1"\ntoken_in = "llamacpp"\n\n'
                      '[[upstreams]]\nname = "chat"\nbase_url = "http://127.0.0.1:8/v1"\n')
    pool = build_pool(Settings(config=config, data_dir=tmp_path), None, None)
    by_name = {c.upstream.name: c.upstream for c in pool.credentials}
    assert (by_name["engine"].token_in, by_name["engine"].capture_tokens) == ("llamacpp", "llamacpp")
    assert (by_name["chat"].token_in, by_name["chat"].capture_tokens) == (None, None)
    flag = build_pool(Settings(upstream_url=["http://127.0.0.1:7/v1"], token_in="vllm", data_dir=tmp_path), None, None)
    assert [(c.upstream.token_in, c.upstream.capture_tokens) for c in flag.credentials] == [("vllm", "vllm")]
    assert [c.upstream.token_in for c in build_pool(Settings(upstream_url=["http://127.0.0.1:7/v1"], data_dir=tmp_path),
                                                    None, None).credentials] == [None]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[upstreams]]\nbase_url = "http://127.0.0.1:9/v1"\ntoken_in = "sglang"\n')
    from gateway.settings import SettingsError

    with pytest.raises(SettingsError, match="token_in"):
        build_pool(Settings(config=bad, data_dir=tmp_path), None, None)


@pytest.mark.parametrize("mode", MODES)
def test_think_tags_of_a_token_in_answer_are_reasoning_per_the_reasoning_tags_setting(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    from gateway.simulator.reply import REASONING, TEXT

    gateway = start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=mode, token_in="vllm",
                            api_key=[CLIENT_KEY], reasoning_tags={"reasoning*": "auto"})
    rollout, nonce = f"ti.{secrets.token_hex(4)}", secrets.token_hex(6)
    client = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key=CLIENT_KEY,
                                 _strict_response_validation=True, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: hello"}]
    finals = []
    for question in ("and again", None):
        with client.messages.stream(model="reasoning", max_tokens=512, messages=messages) as s:  # type: ignore[arg-type]
            final = s.get_final_message()
        finals.append(final)
        if question:
            messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                         {"role": "user", "content": question}]
    for final in finals:  # chat's reasoning_content (turn 1) and token-in's <think> text (turn 2) alike
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == REASONING and final.content[1].text == TEXT  # type: ignore[union-attr]
    calls = read_back(gateway, rollout)["calls"]
    assert [c["token_in"]["status"] for c in calls] == ["skipped: first_turn", "used"]
    assert calls[1]["answer"]["reasoning"] == REASONING and calls[1]["answer"]["text"] == TEXT
    sent = [r for r in engine_requests(simulator, nonce) if r["path"] == "/v1/completions"]
    assert len(sent) == 1 and sent[0]["body"]["prompt"] == calls[1]["tokens"]["prompt_ids"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_chat_client_that_asked_for_logprobs_gets_the_engines_on_a_token_in_turn(
    token_in_gateways: dict[str, Gateway], simulator: Simulator, stream: bool
) -> None:
    gateway, rollout, nonce = token_in_gateways["realtime"], f"ti.{secrets.token_hex(4)}", secrets.token_hex(6)
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY,
                           _strict_response_validation=True, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: hi"}]
    first = client.chat.completions.create(model="text", messages=messages).choices[0].message  # type: ignore[arg-type]
    messages += [first.model_dump(exclude_none=True, exclude={"parsed"}), {"role": "user", "content": "again"}]
    if stream:
        with client.chat.completions.stream(model="text", messages=messages, logprobs=True, top_logprobs=0) as s:  # type: ignore[arg-type]
            choice = s.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(model="text", messages=messages, logprobs=True, top_logprobs=0).choices[0]  # type: ignore[arg-type]
    entries = choice.logprobs.content if choice.logprobs else None
    assert entries and "".join(e.token for e in entries) == choice.message.content
    calls = read_back(gateway, rollout)["calls"]
    assert calls[1]["token_in"]["status"] == "used"
    assert [e.logprob for e in entries] == calls[1]["tokens"]["completion_logprobs"][: len(entries)]


def test_two_replicas_on_postgresql_continue_each_others_calls(
    server_loop: ServerLoop, simulator: Simulator, postgres_schema: str, tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each turn on the other replica: the earlier calls come from the shared store. The
    history read is bounded (2 s) so that a stalled store costs a call its token-in, not its
    answer; on a busy machine a PostgreSQL read can take that long, so this test gives it the
    time it needs (the bounded fallback is the product's, tested on its own)."""
    from gateway.rollout import recorder

    monkeypatch.setattr(recorder, "HISTORY_TIMEOUT", 60.0)
    a, b = (start_gateway(server_loop, simulator, tmp_path_factory, token_in="vllm", api_key=[CLIENT_KEY],
                          database_url=postgres_schema, replica_id=name) for name in ("replica-a", "replica-b"))
    rollout, nonce = f"ti.pg.{secrets.token_hex(4)}", secrets.token_hex(6)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {PLAN}"}]
    for gateway in (a, b, a):
        client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY,
                               _strict_response_validation=True, max_retries=0)
        message = client.chat.completions.create(model="agent;chunk=7", messages=messages, tools=CHAT_TOOLS).choices[0].message  # type: ignore[arg-type]
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
    assert message.content == "Done. The tool said: get_time says 18 C"
    check_token_in_rollout(b, simulator, rollout, nonce)


def test_engine_completion_chunks_are_data_bearing_for_the_attempt_bounds() -> None:
    """Text-completion chunks (vLLM token-in, the relayed /v1/completions) and llama.cpp's
    /completion chunks reset the idle bound and are not empty events; an empty one is."""
    from gateway.upstream.bounds import carries_something

    assert carries_something({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
    assert carries_something({"content": "a", "tokens": [1], "stop": False})
    assert carries_something({"content": "", "tokens": [], "stop": True, "stop_type": "eos"})
    assert not carries_something({"choices": [{"index": 0, "text": "", "finish_reason": None}]})
    assert not carries_something({"content": "", "tokens": [], "stop": False})


async def test_a_failover_to_an_upstream_without_token_in_is_recorded_as_such() -> None:
    from gateway.generation.policy import StreamPolicy
    from gateway.settings import Settings
    from gateway.upstream.client import UpstreamClient
    from gateway.upstream.credential import Credential, Upstream
    from gateway.upstream.token_in import TokenIn

    fake = FakeLlama([1, 2, 3, 99])
    client = UpstreamClient(http=httpx.AsyncClient(transport=httpx.MockTransport(fake)))
    token_in = TokenIn(LLAMA_PLAN, LLAMA_BODY, client)
    policy = StreamPolicy.snapshot(Settings(upstream_url=["http://llama.test/v1"]))
    engine = Credential(Upstream("llama", "http://llama.test/v1", token_in="llamacpp"), None)
    chat = Credential(Upstream("chat", "http://chat.test/v1"), None)
    [i async for i in token_in.send(engine, LLAMA_BODY, policy)]
    assert token_in.status == "used" and token_in.prompt_ids is not None
    [i async for i in token_in.send(chat, LLAMA_BODY, policy)]
    await client.aclose()
    assert token_in.status == "skipped: chat_upstream" and token_in.prompt_ids is None
    assert fake.seen[-1][0] == "/v1/chat/completions"
