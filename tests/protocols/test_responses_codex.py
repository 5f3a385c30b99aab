"""Codex's Responses features through the gateway, both modes: client-executed tool types
(``custom`` freeform, ``local_shell``, ``shell``, ``apply_patch``) as function tools
upstream and their own items back (SDK strict mode, raw-event invariants), their replay,
``tool_choice`` naming dropped tools, compaction turns and ``POST /v1/responses/compact``,
and ``count_tokens`` never answering 0.

The freeform ``apply_patch`` declaration is the one Codex 0.171.0 sent (taken from
tests/fixtures/codex_ws_apply_patch.jsonl, frames captured from the real CLI).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.errors import GatewayError
from gateway.protocols.envelope import PREFIX, PROCESS_KEYRING, Tenant
from gateway.protocols.responses.compaction import SUMMARY_PROMPT, compaction_item
from gateway.protocols.responses.translate import translate
from tests.conftest import Gateway, Simulator
from tests.protocols.test_responses import assert_stream_invariants, client, raw_events, sdk_stream

FIXTURES = Path(__file__).parents[1] / "fixtures"
CODEX_FRAMES = [
    json.loads(line) for line in (FIXTURES / "codex_ws_apply_patch.jsonl").read_text().splitlines()
]
APPLY_PATCH = next(t for t in CODEX_FRAMES[0]["tools"] if t["type"] == "custom")
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"


def call(name: str, arguments: dict[str, Any]) -> str:
    """A user message the simulator's ``agent`` answers with exactly this tool call."""
    return f"Please act. CALL {name} {json.dumps(arguments)}"


def upstream_bodies(simulator: Simulator) -> list[dict[str, Any]]:
    return [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]


# -- the declaration, as Codex sends it ---------------------------------------------------


def test_codex_tools_translate_to_function_tools() -> None:
    """Pure: the real CLI's tool list -> function tools; hosted ones dropped and named."""
    frame = {k: v for k, v in CODEX_FRAMES[1].items() if k not in ("type", "previous_response_id")}
    t = translate(frame)
    functions = {tool["function"]["name"]: tool["function"] for tool in t.upstream["tools"]}
    patch = functions["apply_patch"]
    assert patch["parameters"]["required"] == ["input"]
    assert patch["parameters"]["properties"]["input"]["type"] == "string"
    assert patch["description"].startswith(APPLY_PATCH["description"])
    assert APPLY_PATCH["format"]["definition"] in patch["description"]
    assert "lark grammar" in patch["description"]
    assert t.tool_map.kinds == {"apply_patch": "custom"}
    assert "exec_command" in functions
    assert set(t.dropped_tools) == {"web_search", "tool_search"}


# -- the model's call comes back as the tool's own item ----------------------------------

CLIENT_TOOLS: list[tuple[dict[str, Any], str, dict[str, Any], dict[str, Any]]] = [
    # (declaration, upstream function name, arguments the model sends, fields of the item)
    (APPLY_PATCH, "apply_patch", {"input": PATCH}, {"type": "custom_tool_call", "name": "apply_patch", "input": PATCH}),
    (
        {"type": "local_shell"},
        "local_shell",
        {"command": ["ls", "-la"], "working_directory": "/tmp", "timeout_ms": 5000},
        {
            "type": "local_shell_call",
            "action": {"type": "exec", "command": ["ls", "-la"], "env": {}, "timeout_ms": 5000, "working_directory": "/tmp"},
        },
    ),
    (
        {"type": "shell", "environment": {"type": "local"}},
        "shell",
        {"commands": ["echo one", "echo two"]},
        {"type": "shell_call", "action": {"commands": ["echo one", "echo two"]}},
    ),
    (
        {"type": "apply_patch"},
        "apply_patch",
        {"type": "create_file", "path": "a.txt", "diff": "+hi\n"},
        {"type": "apply_patch_call", "status": "completed", "operation": {"type": "create_file", "path": "a.txt", "diff": "+hi\n"}},
    ),
]


def _item_fields(item: Any, expected: dict[str, Any]) -> dict[str, Any]:
    if isinstance(item, dict):
        return {k: item.get(k) for k in expected}
    data = item.model_dump(mode="json", exclude_none=True)
    return {k: data.get(k) for k in expected}


@pytest.mark.parametrize("tool,upstream,arguments,expected", CLIENT_TOOLS, ids=[c[3]["type"] for c in CLIENT_TOOLS])
def test_client_tool_calls_stream_as_their_items(
    gateway: Gateway, simulator: Simulator, tool: dict[str, Any], upstream: str, arguments: dict[str, Any], expected: dict[str, Any]
) -> None:
    simulator.clear()
    final, events = sdk_stream(gateway, "agent", input=call(upstream, arguments), tools=[tool])
    assert final.status == "completed"
    assert len(final.output) == 1
    item = final.output[0]
    assert _item_fields(item, expected) == expected
    assert item.call_id == "call_agent_0"
    sent = upstream_bodies(simulator)[0]
    assert [t["function"]["name"] for t in sent["tools"]] == [upstream]
    if expected["type"] == "custom_tool_call":
        deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
        done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
        assert deltas == PATCH and [e.input for e in done] == [PATCH]
        assert {e.item_id for e in done} == {item.id}
    # the raw stream keeps every invariant, each event valid for the SDK's strict models
    _, raw, text = raw_events(gateway, {"model": "agent", "input": call(upstream, arguments), "tools": [tool]})
    assert_stream_invariants(raw, text)
    added = [e["item"] for e in raw if e["type"] == "response.output_item.added"]
    assert [a["type"] for a in added] == [expected["type"]]


@pytest.mark.parametrize("tool,upstream,arguments,expected", CLIENT_TOOLS, ids=[c[3]["type"] for c in CLIENT_TOOLS])
def test_client_tool_calls_in_json_answers(
    gateways: dict[str, Gateway], tool: dict[str, Any], upstream: str, arguments: dict[str, Any], expected: dict[str, Any]
) -> None:
    gateway = gateways["compatible"]  # no stream: one mode is enough
    response = client(gateway).responses.create(model="agent", input=call(upstream, arguments), tools=[tool])  # type: ignore[list-item]
    assert [_item_fields(item, expected) for item in response.output] == [expected]


def test_text_before_a_custom_call_keeps_both_items(gateway: Gateway, simulator: Simulator) -> None:
    """A message, then the custom call: two items in order, indexes 0 and 1."""
    frames = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Patching. "}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_p", "type": "function", "function": {"name": "apply_patch", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": json.dumps({"input": PATCH})[:20]}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": json.dumps({"input": PATCH})[20:]}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"_op": "done"},
    ]
    model = simulator.script(frames)
    final, _ = sdk_stream(gateway, model, input="patch it", tools=[APPLY_PATCH])
    assert [i.type for i in final.output] == ["message", "custom_tool_call"]
    assert final.output[1].input == PATCH and final.output[1].call_id == "call_p"


# -- replayed items translate back ----------------------------------------------------------

REPLAYS: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any], str, dict[str, Any], str]] = [
    # (declaration, call item, output item, upstream name, upstream arguments, tool message text)
    (
        APPLY_PATCH,
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Success. A hello.txt"},
        "apply_patch", {"input": PATCH}, "Success. A hello.txt",
    ),
    (
        {"type": "local_shell"},
        {"type": "local_shell_call", "id": "ls1", "call_id": "c2", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "env": {}}},
        {"type": "local_shell_call_output", "id": "c2", "output": "a.txt\n"},
        "local_shell", {"command": ["ls"], "env": {}}, "a.txt\n",
    ),
    (
        {"type": "shell"},
        {"type": "shell_call", "call_id": "c3", "action": {"commands": ["pwd"]}},
        {"type": "shell_call_output", "call_id": "c3",
         "output": [{"stdout": "/w\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}]},
        "shell", {"commands": ["pwd"]}, "/w\n\n(exit code 0)",
    ),
    (
        {"type": "apply_patch"},
        {"type": "apply_patch_call", "call_id": "c4", "status": "completed",
         "operation": {"type": "delete_file", "path": "old.txt"}},
        {"type": "apply_patch_call_output", "call_id": "c4", "status": "completed", "output": "deleted"},
        "apply_patch", {"type": "delete_file", "path": "old.txt"}, "completed: deleted",
    ),
]


@pytest.mark.parametrize("tool,item,output,name,arguments,text", REPLAYS, ids=[r[1]["type"] for r in REPLAYS])
def test_replayed_client_tool_items_reach_the_upstream(
    gateway: Gateway, simulator: Simulator, tool: dict[str, Any], item: dict[str, Any],
    output: dict[str, Any], name: str, arguments: dict[str, Any], text: str,
) -> None:
    simulator.clear()
    final, _ = sdk_stream(gateway, "agent", input=[{"role": "user", "content": "go"}, item, output], tools=[tool])
    assert final.output[0].type == "message"
    messages = upstream_bodies(simulator)[0]["messages"]
    assistant, result = messages[1], messages[2]
    assert assistant["role"] == "assistant"
    [tool_call] = assistant["tool_calls"]
    assert tool_call["function"]["name"] == name
    assert json.loads(tool_call["function"]["arguments"]) == arguments
    assert result == {"role": "tool", "tool_call_id": tool_call["id"], "content": text}


# -- tool_choice and dropped tools --------------------------------------------------------


def test_tool_choice_names_a_client_tool(gateways: dict[str, Gateway], simulator: Simulator) -> None:
    gateway = gateways["compatible"]  # no stream: one mode is enough
    simulator.clear()
    cases = (
        ({"type": "custom", "name": "apply_patch"}, APPLY_PATCH, call("apply_patch", {"input": PATCH})),
        ({"type": "local_shell"}, {"type": "local_shell"}, call("local_shell", {"command": ["ls"]})),
    )
    for choice, tool, prompt in cases:
        response = httpx.post(
            gateway.base_url + "/responses",
            json={"model": "agent", "input": prompt, "tools": [tool], "tool_choice": choice},
        )
        assert response.status_code == 200, response.text
    sent = [b["tool_choice"] for b in upstream_bodies(simulator)]
    assert sent == [{"type": "function", "function": {"name": "apply_patch"}}, {"type": "function", "function": {"name": "local_shell"}}]


@pytest.mark.parametrize(
    "tools,choice",
    [
        ([{"type": "web_search"}], {"type": "web_search"}),
        ([{"type": "shell", "environment": {"type": "container_auto"}}], {"type": "shell"}),
        ([{"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "x"}]}], {"type": "function", "name": "x", "namespace": "ns"}),
    ],
)
def test_tool_choice_naming_a_dropped_tool_is_a_named_400(
    gateways: dict[str, Gateway], simulator: Simulator, tools: list[dict[str, Any]], choice: dict[str, Any]
) -> None:
    gateway = gateways["compatible"]  # no stream: one mode is enough
    simulator.clear()
    response = httpx.post(
        gateway.base_url + "/responses", json={"model": "text", "input": "hi", "tools": tools, "tool_choice": choice}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "tool_choice_unavailable"
    assert response.json()["error"]["param"] == "tool_choice"
    assert upstream_bodies(simulator) == []


def test_hosted_shell_is_dropped_and_local_shell_kept() -> None:
    t = translate({"model": "m", "input": "hi", "tools": [
        {"type": "shell", "environment": {"type": "container_auto"}}, {"type": "local_shell"}, {"type": "file_search"},
    ]})
    assert [tool["function"]["name"] for tool in t.upstream["tools"]] == ["local_shell"]
    assert t.dropped_tools == ["shell", "file_search"]


# -- compaction --------------------------------------------------------------------------

HISTORY: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the bug in main.py"}]},
    {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd":"cat main.py"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "print(1)"},
]


def _compaction_request(stream: bool) -> dict[str, Any]:
    return {
        "model": "text",
        "instructions": "Caller's rules.",
        "input": [*HISTORY, {"type": "compaction_trigger"}],
        "tools": [APPLY_PATCH, {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}],
        "stream": stream,
        "store": False,
    }


def test_compaction_turn_streams_one_compaction_item(gateway: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    _, events, raw = raw_events(gateway, _compaction_request(True))
    assert_stream_invariants(events, raw)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    [item] = final["output"]
    assert item["type"] == "compaction" and item["encrypted_content"].startswith(PREFIX)
    assert [e["type"] for e in events[2:]] == ["response.output_item.added", "response.output_item.done", "response.completed"]
    # the summarising generation: caller's instructions first, the history, the summary request; no tools
    [sent] = upstream_bodies(simulator)
    assert sent["messages"][0] == {"role": "system", "content": "Caller's rules."}
    assert sent["messages"][-1] == {"role": "user", "content": SUMMARY_PROMPT}
    assert any(m["role"] == "tool" and m["content"] == "print(1)" for m in sent["messages"])
    assert "tools" not in sent and "tool_choice" not in sent
    # the SDK in strict mode accepts the same stream
    with client(gateway).responses.stream(**{k: v for k, v in _compaction_request(True).items() if k != "stream"}) as stream:
        list(stream)
        assert [i.type for i in stream.get_final_response().output] == ["compaction"]


def test_compaction_item_round_trip(gateway: Gateway, simulator: Simulator) -> None:
    """JSON compaction turn, then the item replayed: the upstream reads the summary."""
    simulator.clear()
    response = httpx.post(gateway.base_url + "/responses", json={**_compaction_request(False), "model": "echo"})
    assert response.status_code == 200, response.text
    [item] = response.json()["output"]
    assert item["type"] == "compaction"
    summary = "You said: " + SUMMARY_PROMPT  # the echo scenario's summary
    simulator.clear()
    final, _ = sdk_stream(gateway, "echo", input=[HISTORY[0], item, {"role": "user", "content": "continue"}])
    messages = upstream_bodies(simulator)[0]["messages"]
    assert messages[1]["role"] == "user" and messages[1]["content"].endswith(summary)
    assert messages[2] == {"role": "user", "content": "continue"}
    assert final.output_text == "You said: continue"


def test_compact_endpoint_answers_the_compacted_item_list(gateway: Gateway, simulator: Simulator) -> None:
    simulator.clear()
    compacted = client(gateway).responses.compact(model="text", input=HISTORY, instructions="Caller's rules.")  # type: ignore[arg-type]
    assert compacted.object == "response.compaction"
    [item] = compacted.output
    assert item.type == "compaction" and item.encrypted_content.startswith(PREFIX)
    assert compacted.usage.input_tokens > 0
    [sent] = upstream_bodies(simulator)
    assert sent["messages"][0]["content"] == "Caller's rules." and sent["messages"][-1]["content"] == SUMMARY_PROMPT
    bad = httpx.post(gateway.base_url + "/responses/compact", json={"input": HISTORY})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    "items,code",
    [
        ([{"type": "compaction_trigger"}, {"role": "user", "content": "late"}], "invalid_compaction_trigger"),
        ([{"type": "compaction", "encrypted_content": "gAAAA-openai-owned"}], "invalid_compaction_item"),
    ],
)
def test_bad_compaction_items_are_named_400s(gateways: dict[str, Gateway], simulator: Simulator, items: list[Any], code: str) -> None:
    gateway = gateways["compatible"]  # no stream: one mode is enough
    simulator.clear()
    response = httpx.post(gateway.base_url + "/responses", json={"model": "text", "input": items})
    assert response.status_code == 400 and response.json()["error"]["code"] == code
    assert upstream_bodies(simulator) == []


def test_compaction_envelope_altered_or_from_before_encryption_is_a_named_400() -> None:
    """Envelopes are encrypted and authenticated now (tests/protocols/test_envelopes.py): one whose
    tag does not match, or an unencrypted ``cb2a1.`` one of earlier versions, is refused
    before anything goes upstream instead of being read as the summary."""
    tenant = Tenant("client:0123456789abcdef", lambda: PROCESS_KEYRING)
    item = compaction_item("the summary", tenant)
    assert translate({"model": "m", "input": [item]}, tenant=tenant).upstream["messages"][0]["content"].endswith("the summary")
    sealed = item["encrypted_content"]
    altered = sealed[:-6] + ("AAAAAA" if not sealed.endswith("AAAAAA") else "BBBBBB")
    legacy = "cb2a1.eyJjIjogInN1bW1hcnkifQ==.0123456789abcdef0123456789abcdef"
    for value in (altered, legacy):
        with pytest.raises(GatewayError) as caught:
            translate({"model": "m", "input": [{**item, "encrypted_content": value}]}, tenant=tenant)
        assert caught.value.code == "invalid_encrypted_content" and caught.value.status == 400
        assert caught.value.param == "input[0].encrypted_content"


# -- count_tokens ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [{"role": "user", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": "s", "tools": [
            {"name": "t", "input_schema": {"type": "object"}}]},
    ],
)
def test_count_tokens_is_never_zero(gateways: dict[str, Gateway], body: dict[str, Any]) -> None:
    gateway = gateways["compatible"]  # no stream: one mode is enough
    response = httpx.post(gateway.base_url + "/messages/count_tokens", json=body)
    assert response.status_code == 200
    assert response.json()["input_tokens"] >= 1


def test_custom_input_stream_decodes_fragments_in_agreement() -> None:
    """Pure: JSON fragments (escapes split anywhere) -> decoded input pieces whose
    concatenation is exactly the final input; parses throttled."""
    from gateway.protocols.responses.client_tool_calls import CustomInputStream

    value = 'line "one"\n\\ line two \u00e9\n' * 40
    arguments = json.dumps({"input": value}, ensure_ascii=True)
    for size in (1, 3, 7, 300):
        stream = CustomInputStream()
        pieces = [stream.feed(arguments[i : i + size]) for i in range(0, len(arguments), size)]
        pieces.append(stream.finish(arguments))
        assert "".join(pieces) == value == stream.sent
        assert sum(1 for p in pieces if p) <= len(arguments) // CustomInputStream.PARSE_STEP + 3
    raw = CustomInputStream()
    assert raw.finish("not json") == "not json"  # arguments that are not the object: raw input


def test_compact_route_keys_and_audits_like_every_generation_route(
    server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.conftest import start_gateway
    from tests.observability.test_audit import audit_rows

    gw = start_gateway(server_loop, simulator, tmp_path_factory, api_key=["sk-compact-client-key-0001"])
    body = {"model": "text", "input": HISTORY}
    refused = httpx.post(gw.base_url + "/responses/compact", json=body)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.post(gw.base_url + "/responses/compact", json=body, headers={"authorization": "Bearer sk-compact-client-key-0001"})
    assert ok.status_code == 200 and ok.json()["object"] == "response.compaction"
    rows = audit_rows(gw, 2)
    assert sorted((r["protocol"], r["outcome"], r["streamed"]) for r in rows) == [
        ("responses", "refused", False), ("responses", "success", False),
    ]
