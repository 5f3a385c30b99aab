"""Rollouts end to end (docs/capture.md): `/rollouts/R/v1/...` base URLs, a call record per
model call readable the moment the client has the terminal event, token continuity and the
trajectory against the simulator's vLLM fields, freeze / 409 / delete, stickiness, and a
store that cannot write."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from websockets.sync.client import connect

from gateway.simulator.scenarios import assemble_completion, build_plan
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for

CLIENT_KEY = "ck-rollouts-client-key-0123456789"
CALLS = 'CALL get_weather {"city": "Paris"} then CALL get_time {"timezone": "Europe/Paris"}'
MODES = ["compatible", "realtime"]
ReadBack = Callable[[], dict[str, Any]]


@pytest.fixture(scope="module")
def rollout_gateways(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gateway]:
    return {
        mode: start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=mode, capture_tokens="vllm",
                            api_key=[CLIENT_KEY])
        for mode in MODES
    }


def new_rollout(kind: str) -> str:
    return f"{kind}.{secrets.token_hex(4)}:r-1"


def read_back(gateway: Gateway, rollout: str, part: str = "") -> dict[str, Any]:
    response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}{part}", headers=gateway.admin, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def expected_tokens(body: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """What the simulator sent for this upstream body: prompt ids, completion ids, logprobs."""
    plan = build_plan(body["model"], body)
    folded = assemble_completion(plan.frames, body["model"])
    choice = folded["choices"][0]
    logprobs = [e["logprob"] for e in (choice["logprobs"] or {}).get("content", [])]
    return folded["prompt_token_ids"], choice["token_ids"], logprobs


def sent_upstream(simulator: Simulator, nonce: str) -> list[dict[str, Any]]:
    """The upstream requests of one conversation (its nonce is in the first user message)."""
    return [r for r in simulator.requests() if r["path"].endswith("/chat/completions") and nonce in json.dumps(r["body"])]


def expected_segment(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [expected_tokens(b) for b in bodies]
    prompt, completion, _ = calls[-1]
    tokens = prompt + completion
    mask = [0] * len(tokens)
    logprobs: list[float | None] = [None] * len(tokens)
    for p, c, lps in calls:
        assert tokens[: len(p) + len(c)] == p + c  # each call extends the one before, token for token
        for k, lp in enumerate(lps):
            mask[len(p) + k], logprobs[len(p) + k] = 1, lp
    return {"tokens": tokens, "mask": mask, "logprobs": logprobs, "weight_versions": []}


class Seen:
    """What the read-back showed at each terminal event."""

    def __init__(self) -> None:
        self.snapshots: list[dict[str, Any]] = []

    def at_terminal(self, read: ReadBack, answer: dict[str, Any]) -> None:
        snap = read()
        self.snapshots.append(snap)
        assert len(snap["calls"]) == len(self.snapshots), "the call's record is not readable at the terminal event"
        last = snap["calls"][-1]
        assert last["outcome"] == "success" and last["seq"] == len(self.snapshots) - 1
        # the terminal was handed over before the client could read it: delivered at once
        assert last["delivered"] is True and snap["undelivered"] == [] and snap["forked"] is False
        assert last["answer"]["text"] == answer["text"]
        assert [(c["name"], json.loads(c["arguments"])) for c in last["answer"]["tool_calls"]] == answer["tool_calls"]


def check_rollout(gateway: Gateway, simulator: Simulator, rollout: str, nonce: str, protocol: str, seen: Seen) -> None:
    snap = read_back(gateway, rollout)
    assert snap["rollout_id"] == rollout and snap["complete"] is True and snap["incomplete"] == [] and not snap["frozen"]
    calls = snap["calls"]
    requests = sent_upstream(simulator, nonce)
    assert len(calls) == len(requests) == 3
    for request in requests:  # the rollout id never goes upstream
        assert rollout not in json.dumps(request["body"]) and rollout not in json.dumps(request["headers"])
    bodies = [r["body"] for r in requests]
    ids = [c["call_id"] for c in calls]
    for n, (call, body) in enumerate(zip(calls, bodies)):
        prompt, completion, logprobs = expected_tokens(body)
        assert call["rollout_id"] == rollout and call["protocol"] == protocol and call["seq"] == n
        assert call["upstream"] == "upstream" and call["model"] == "agent;chunk=7"
        assert call["tokens"] == {"prompt_ids": prompt, "completion_ids": completion, "completion_logprobs": logprobs}
        assert call["continuity"] == {"previous_call_id": ids[n - 1] if n else None, "prefix": "exact", "diverged_at": None}
        assert call["upstream_request"]["return_token_ids"] is True and call["upstream_request"]["logprobs"] is True
        assert call["started_at"] <= call["ended_at"]
    assert [c["answer"]["finish_reason"] for c in calls] == ["tool_calls", "tool_calls", "stop"]
    trajectory = read_back(gateway, rollout, "/trajectory")
    assert trajectory == {"rollout_id": rollout, "segments": [{"call_ids": ids, **expected_segment(bodies)}]}
    listed = httpx.get(gateway.url + "/admin/api/rollouts", params={"since": calls[0]["started_at"]}, headers=gateway.admin).json()
    [entry] = [r for r in listed["rollouts"] if r["rollout_id"] == rollout]
    assert entry["calls"] == 3 and entry["complete"] is True and entry["frozen"] is False
    assert entry["updated_at"] == pytest.approx(calls[-1]["ended_at"])
    assert [s["calls"][-1]["call_id"] for s in seen.snapshots] == ids


# -- Messages -------------------------------------------------------------------------------

MESSAGES_TOOLS = [
    {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_time", "description": "Time", "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}}},
]


def messages_turn(client: anthropic.Anthropic, messages: list[dict[str, Any]], stream: bool, seen: Seen, read: ReadBack) -> Any:
    def answer_of(message: Any) -> dict[str, Any]:
        return {"text": "".join(b.text for b in message.content if b.type == "text"),
                "tool_calls": [(b.name, b.input) for b in message.content if b.type == "tool_use"]}

    if not stream:
        final = client.messages.create(model="agent;chunk=7", max_tokens=512, messages=messages, tools=MESSAGES_TOOLS)  # type: ignore[arg-type]
        seen.at_terminal(read, answer_of(final))
        return final
    with client.messages.stream(model="agent;chunk=7", max_tokens=512, messages=messages, tools=MESSAGES_TOOLS) as s:  # type: ignore[arg-type]
        for event in s:
            if event.type == "message_stop":  # the terminal: the record is there already
                seen.at_terminal(read, answer_of(s.current_message_snapshot))
        return s.get_final_message()


def messages_conversation(gateway: Gateway, rollout: str, nonce: str, stream: bool, seen: Seen) -> list[dict[str, Any]]:
    client = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key=CLIENT_KEY,
                                 _strict_response_validation=True, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {CALLS}"}]
    for _ in range(3):
        final = messages_turn(client, messages, stream, seen, lambda: read_back(gateway, rollout))
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]})
        uses = [b for b in final.content if b.type == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": f"{u.name} says 18 C"} for u in uses]})
    assert final.stop_reason == "end_turn" and final.content[0].text.startswith("Done. The tool said: get_time")
    return messages


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("mode", MODES)
def test_messages_three_tool_turns_under_a_rollout_base_url(
    rollout_gateways: dict[str, Gateway], simulator: Simulator, mode: str, stream: bool
) -> None:
    gateway, rollout, nonce, seen = rollout_gateways[mode], new_rollout("msg"), secrets.token_hex(6), Seen()
    messages_conversation(gateway, rollout, nonce, stream, seen)
    check_rollout(gateway, simulator, rollout, nonce, "messages", seen)


# -- Chat Completions -----------------------------------------------------------------------

CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
              for t in MESSAGES_TOOLS]


def openai_client(gateway: Gateway, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY,
                         _strict_response_validation=True, max_retries=0)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("mode", MODES)
def test_chat_three_tool_turns_under_a_rollout_base_url(
    rollout_gateways: dict[str, Gateway], simulator: Simulator, mode: str, stream: bool
) -> None:
    gateway, rollout, nonce, seen = rollout_gateways[mode], new_rollout("chat"), secrets.token_hex(6), Seen()
    client = openai_client(gateway, rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {CALLS}"}]

    def answer_of(message: Any) -> dict[str, Any]:
        return {"text": message.content or "",
                "tool_calls": [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]}

    for _ in range(3):
        if stream:
            with client.chat.completions.stream(model="agent;chunk=7", messages=messages, tools=CHAT_TOOLS) as s:  # type: ignore[arg-type]
                for event in s:
                    if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].finish_reason:
                        seen.at_terminal(lambda: read_back(gateway, rollout), answer_of(s.current_completion_snapshot.choices[0].message))
                message = s.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(model="agent;chunk=7", messages=messages, tools=CHAT_TOOLS).choices[0].message  # type: ignore[arg-type]
            seen.at_terminal(lambda: read_back(gateway, rollout), answer_of(message))
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
    assert message.content and message.content.startswith("Done. The tool said: get_time")
    check_rollout(gateway, simulator, rollout, nonce, "chat", seen)


# -- Responses (HTTP and WebSocket) ---------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"],
                    "strict": False} for t in MESSAGES_TOOLS]


def responses_answer(output: list[dict[str, Any]]) -> dict[str, Any]:
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"] if p["type"] == "output_text")
    calls = [(item["name"], json.loads(item["arguments"])) for item in output if item["type"] == "function_call"]
    return {"text": text, "tool_calls": calls}


def next_input(items: list[dict[str, Any]], output: list[dict[str, Any]]) -> None:
    for item in output:
        items.append({k: v for k, v in item.items() if k != "status" or item["type"] == "message"})
        if item["type"] == "function_call":
            items.append({"type": "function_call_output", "call_id": item["call_id"], "output": f"{item['name']} says 18 C"})


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("mode", MODES)
def test_responses_three_tool_turns_under_a_rollout_base_url(
    rollout_gateways: dict[str, Gateway], simulator: Simulator, mode: str, stream: bool
) -> None:
    gateway, rollout, nonce, seen = rollout_gateways[mode], new_rollout("resp"), secrets.token_hex(6), Seen()
    client = openai_client(gateway, rollout)
    items: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {CALLS}"}]
    for _ in range(3):
        if stream:
            with client.responses.stream(model="agent;chunk=7", input=items, tools=RESPONSES_TOOLS, store=False) as s:  # type: ignore[arg-type]
                for event in s:
                    if event.type == "response.completed":
                        output = [o.model_dump(exclude_none=True) for o in event.response.output]
                        seen.at_terminal(lambda: read_back(gateway, rollout), responses_answer(output))
                response = s.get_final_response()
        else:
            response = client.responses.create(model="agent;chunk=7", input=items, tools=RESPONSES_TOOLS, store=False)  # type: ignore[arg-type]
            seen.at_terminal(lambda: read_back(gateway, rollout), responses_answer([o.model_dump(exclude_none=True) for o in response.output]))
        next_input(items, [o.model_dump(exclude_none=True) for o in response.output])
    assert response.output_text.startswith("Done. The tool said: get_time")
    check_rollout(gateway, simulator, rollout, nonce, "responses", seen)


@pytest.mark.parametrize("mode", MODES)
def test_responses_websocket_turns_under_a_rollout_base_url(
    rollout_gateways: dict[str, Gateway], simulator: Simulator, mode: str
) -> None:
    from openai._models import validate_type
    from openai.types.responses import ResponseStreamEvent

    gateway, rollout, nonce, seen = rollout_gateways[mode], new_rollout("ws"), secrets.token_hex(6), Seen()
    url = gateway.url.replace("http://", "ws://") + f"/rollouts/{rollout}/v1/responses"
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{nonce}: {CALLS}"}]}]
    with connect(url, additional_headers={"authorization": f"Bearer {CLIENT_KEY}"}) as ws:
        for _ in range(3):
            ws.send(json.dumps({"type": "response.create", "model": "agent;chunk=7", "input": items,
                                "tools": RESPONSES_TOOLS, "store": False}))
            while True:
                event = json.loads(ws.recv(timeout=20))
                validate_type(type_=ResponseStreamEvent, value=event)
                if event["type"] == "response.completed":
                    output = event["response"]["output"]
                    seen.at_terminal(lambda: read_back(gateway, rollout), responses_answer(output))
                    break
            next_input(items, output)
    check_rollout(gateway, simulator, rollout, nonce, "responses", seen)
    assert all(c["transport"] == "websocket" for c in read_back(gateway, rollout)["calls"])


# -- continuity, freeze, delete -------------------------------------------------------------


def test_an_edited_history_starts_a_new_segment_where_it_diverges(rollout_gateways: dict[str, Gateway], simulator: Simulator) -> None:
    gateway, rollout, nonce = rollout_gateways["realtime"], new_rollout("edit"), secrets.token_hex(6)
    messages = messages_conversation(gateway, rollout, nonce, True, Seen())
    client = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key=CLIENT_KEY,
                                 _strict_response_validation=True, max_retries=0)
    # the harness rewrites the second tool result (as a compaction or a context editor would)
    edited = json.loads(json.dumps(messages))
    edited[2]["content"][0]["content"] = "get_weather says 19 C"
    edited.append({"role": "user", "content": "thanks"})
    client.messages.create(model="agent;chunk=7", max_tokens=512, messages=edited, tools=MESSAGES_TOOLS)  # type: ignore[arg-type]
    calls = read_back(gateway, rollout)["calls"]
    bodies = [r["body"] for r in sent_upstream(simulator, nonce)]
    assert len(calls) == len(bodies) == 4
    before = expected_tokens(bodies[2])
    prompt = expected_tokens(bodies[3])[0]
    full = before[0] + before[1]
    diverged_at = next(i for i, (a, b) in enumerate(zip(full, prompt)) if a != b)
    assert 0 < diverged_at < len(before[0])
    assert calls[3]["continuity"] == {"previous_call_id": calls[2]["call_id"], "prefix": "diverged", "diverged_at": diverged_at}
    segments = read_back(gateway, rollout, "/trajectory")["segments"]
    assert [s["call_ids"] for s in segments] == [[c["call_id"] for c in calls[:3]], [calls[3]["call_id"]]]
    p3, c3, l3 = expected_tokens(bodies[3])
    assert segments[1] == {"call_ids": [calls[3]["call_id"]], "tokens": p3 + c3,
                           "mask": [0] * len(p3) + [1] * len(c3), "logprobs": [None] * len(p3) + l3,
                           "weight_versions": []}


def test_ids_that_drift_are_diverged_where_the_answer_begins(rollout_gateways: dict[str, Gateway], simulator: Simulator) -> None:
    gateway, rollout, nonce = rollout_gateways["compatible"], new_rollout("drift"), secrets.token_hex(6)
    client = openai_client(gateway, rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: say something"}]
    first = client.chat.completions.create(model="echo;tokens=drift", messages=messages).choices[0].message  # type: ignore[arg-type]
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "again"}]
    client.chat.completions.create(model="echo;tokens=drift", messages=messages)  # type: ignore[arg-type]
    calls = read_back(gateway, rollout)["calls"]
    first_prompt = calls[0]["tokens"]["prompt_ids"]
    assert calls[1]["continuity"] == {"previous_call_id": calls[0]["call_id"], "prefix": "diverged", "diverged_at": len(first_prompt)}
    assert len(read_back(gateway, rollout, "/trajectory")["segments"]) == 2


def test_freeze_refuses_later_calls_and_delete_needs_a_freeze(rollout_gateways: dict[str, Gateway]) -> None:
    gateway, rollout = rollout_gateways["compatible"], new_rollout("freeze")
    client = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key=CLIENT_KEY,
                                 _strict_response_validation=True, max_retries=0)
    client.messages.create(model="text", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    admin = gateway.admin
    early = httpx.request("DELETE", f"{gateway.url}/admin/api/rollouts/{rollout}", json={}, headers=admin)
    assert early.status_code == 409 and early.json()["error"]["code"] == "rollout_not_frozen"
    frozen = httpx.post(f"{gateway.url}/admin/api/rollouts/{rollout}/freeze", json={}, headers=admin)
    assert frozen.status_code == 200
    snap = frozen.json()
    assert snap["frozen"] is True and snap["complete"] is True and len(snap["calls"]) == 1
    with pytest.raises(anthropic.ConflictError) as refused:
        client.messages.create(model="text", max_tokens=64, messages=[{"role": "user", "content": "more"}])
    assert refused.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": refused.value.body["error"]["message"]}}  # type: ignore[index]
    assert "frozen" in refused.value.body["error"]["message"]  # type: ignore[index]
    chat = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "text", "messages": [{"role": "user", "content": "x"}]},
                      headers={"authorization": f"Bearer {CLIENT_KEY}", "x-rollout-id": rollout})
    assert chat.status_code == 409 and chat.json()["error"]["code"] == "rollout_frozen"
    assert len(read_back(gateway, rollout)["calls"]) == 1  # refused calls made no model call
    gone = httpx.request("DELETE", f"{gateway.url}/admin/api/rollouts/{rollout}", json={}, headers=admin)
    assert gone.status_code == 204
    missing = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=admin)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "rollout_not_found"


@pytest.mark.parametrize("path,shape", [("/v1/messages", "anthropic"), ("/v1/chat/completions", "openai"), ("/v1/responses", "openai")])
def test_an_invalid_rollout_id_is_a_400_in_the_routes_shape(rollout_gateways: dict[str, Gateway], simulator: Simulator, path: str, shape: str) -> None:
    gateway = rollout_gateways["compatible"]
    body = {"model": "text", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    before = len(simulator.requests())
    for url, headers in ((f"{gateway.url}/rollouts/bad%20id{path}", {}), (f"{gateway.url}/rollouts/{'x' * 129}{path}", {}),
                         (gateway.url + path, {"x-rollout-id": "no/slashes"})):
        response = httpx.post(url, json=body, headers={"authorization": f"Bearer {CLIENT_KEY}", **headers})
        assert response.status_code == 400, response.text
        error = response.json()
        if shape == "anthropic":
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        else:
            assert error["error"]["code"] == "invalid_rollout_id" and error["error"]["param"] == "rollout_id"
    assert len(simulator.requests()) == before  # nothing went upstream


def test_models_count_tokens_and_stored_responses_under_a_rollout(rollout_gateways: dict[str, Gateway]) -> None:
    gateway, rollout = rollout_gateways["compatible"], new_rollout("aux")
    client = openai_client(gateway, rollout)
    assert "agent" in [m.id for m in client.models.list()]
    assert client.models.retrieve("agent").id == "agent"
    stored = client.responses.create(model="text", input="hi", store=True)
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    counted = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key=CLIENT_KEY,
                                  _strict_response_validation=True, max_retries=0).messages.count_tokens(
        model="text", messages=[{"role": "user", "content": "hello there"}])
    assert counted.input_tokens > 0
    assert len(read_back(gateway, rollout)["calls"]) == 1  # one model call: the create


def test_a_rollouts_calls_stay_on_one_credential(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                            upstream_url=[simulator.url + "/v1", simulator.url + "/v1/"])
    upstreams = set()
    for n in range(3):
        rollout = new_rollout(f"sticky{n}")
        client = openai_client(gateway, rollout)
        for _ in range(4):
            client.chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}])
        used = {c["upstream"] for c in read_back(gateway, rollout)["calls"]}
        assert len(used) == 1
        upstreams |= used
    assert upstreams <= {"upstream0", "upstream1"}


# -- a store that cannot write --------------------------------------------------------------

REFUSE_CALLS = ("CREATE TRIGGER refuse_rollout_calls BEFORE INSERT ON rollout_calls "
                "BEGIN SELECT RAISE(ABORT, 'the store refuses this write'); END")


@pytest.mark.parametrize("strict", [False, True], ids=["released", "strict"])
def test_a_store_that_cannot_write_marks_the_rollout_incomplete(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, strict: bool
) -> None:
    # the store refuses the call record, and the spill journal (4 KiB) cannot hold it either
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                            spill_max_bytes=4096, capture_strict=strict)
    gateway.app.state.db.execute(REFUSE_CALLS)
    rollout = new_rollout("broken")
    client = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout}", api_key=CLIENT_KEY,
                                 _strict_response_validation=True, max_retries=0)
    prompt = [{"role": "user", "content": "a long prompt " * 500}]
    if strict:
        with pytest.raises(anthropic.APIStatusError) as failed:
            client.messages.create(model="text", max_tokens=64, messages=prompt)  # type: ignore[arg-type]
        assert failed.value.status_code == 503
        assert failed.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert "--capture-strict" in failed.value.body["error"]["message"]  # type: ignore[index]
    else:
        with client.messages.stream(model="text", max_tokens=64, messages=prompt) as s:  # type: ignore[arg-type]
            final = s.get_final_message()
        assert final.stop_reason == "end_turn" and final.content[0].text.startswith("Hello from the codebuddy2api simulator.")
    snap = read_back(gateway, rollout)
    assert snap["complete"] is False and snap["calls"] == []
    [reason] = snap["incomplete"][:1]
    assert reason.startswith("call req_") and "not durable (lost)" in reason


# -- two replicas on PostgreSQL -------------------------------------------------------------


def test_two_replicas_on_postgresql_read_and_freeze_the_same_rollout(
    server_loop: ServerLoop, simulator: Simulator, postgres_schema: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    a, b = (start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                          database_url=postgres_schema, replica_id=name) for name in ("replica-a", "replica-b"))
    rollout, nonce = new_rollout("pg"), secrets.token_hex(6)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {CALLS}"}]
    for gateway in (a, b, a):  # each turn on the other replica
        message = openai_client(gateway, rollout).chat.completions.create(
            model="agent;chunk=7", messages=messages, tools=CHAT_TOOLS).choices[0].message  # type: ignore[arg-type]
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
    # each call's delivery is confirmed by a write after its answer went out (docs/capture.md
    # "Delivery"): until it lands the read-back lists the call as incomplete (a loaded machine
    # read one such call here)
    wait_for(lambda: all(read_back(g, rollout)["incomplete"] == [] for g in (a, b)), timeout=30)
    seen_a, seen_b = read_back(a, rollout), read_back(b, rollout)
    assert seen_a == seen_b and len(seen_a["calls"]) == 3
    assert [c["continuity"]["prefix"] for c in seen_a["calls"]] == ["exact"] * 3
    assert read_back(a, rollout, "/trajectory") == read_back(b, rollout, "/trajectory")
    assert len(read_back(b, rollout, "/trajectory")["segments"]) == 1
    frozen = httpx.post(f"{b.url}/admin/api/rollouts/{rollout}/freeze", json={}, headers=b.admin)
    assert frozen.status_code == 200 and frozen.json()["frozen"] is True
    with pytest.raises(openai.ConflictError) as refused:
        openai_client(a, rollout).chat.completions.create(model="text", messages=messages)  # type: ignore[arg-type]
    assert refused.value.code == "rollout_frozen"
    assert httpx.request("DELETE", f"{a.url}/admin/api/rollouts/{rollout}", json={}, headers=a.admin).status_code == 204
    assert httpx.get(f"{b.url}/admin/api/rollouts/{rollout}", headers=b.admin).status_code == 404


# -- capture export on the store ------------------------------------------------------------


def test_capture_export_reads_the_store(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    import os
    import subprocess
    import sys

    gateway = start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY])
    rollout = new_rollout("export")
    client = openai_client(gateway, rollout)
    for text in ("one", "two"):
        client.chat.completions.create(model="text", messages=[{"role": "user", "content": text}])
    env = {**os.environ, "CODEBUDDY2API_DATA_DIR": str(gateway.live.current.data_dir)}
    env.pop("CODEBUDDY2API_CAPTURE_DIR", None)
    out = subprocess.run([sys.executable, "-m", "gateway", "capture", "export", "--rollout", rollout],
                         capture_output=True, check=True, timeout=60, env=env)
    exported = [json.loads(line) for line in out.stdout.splitlines()]
    assert exported == read_back(gateway, rollout)["calls"]
    assert [r["upstream_request"]["messages"][-1]["content"] for r in exported] == ["one", "two"]


def test_a_failed_call_is_recorded_with_its_outcome(rollout_gateways: dict[str, Gateway]) -> None:
    gateway, rollout = rollout_gateways["realtime"], new_rollout("failed")
    client = openai_client(gateway, rollout)
    with pytest.raises(openai.APIError):
        with client.chat.completions.stream(model="error_frame", messages=[{"role": "user", "content": "hi"}]) as s:  # type: ignore[arg-type]
            s.get_final_completion()

    def recorded() -> list[dict[str, Any]]:
        response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}", headers=gateway.admin)
        return response.json()["calls"] if response.status_code == 200 else []

    from tests.conftest import wait_for

    wait_for(lambda: recorded())
    [call] = recorded()
    assert call["outcome"] == "error" and call["error_code"] == "upstream_error" and call["tokens"] is None
    assert call["answer"]["partial"] is True and call["answer"]["text"].startswith("Hello from the codebuddy2api simulator.")
    assert call["continuity"] == {"previous_call_id": None, "prefix": "unknown", "diverged_at": None}
