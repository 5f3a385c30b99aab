"""Responses over WebSocket (``GET /v1/responses``), both modes, replaying the frames the
real Codex 0.171.0 CLI sent (tests/fixtures/codex_ws_*.jsonl: developer prompts trimmed):
the prewarm answered without an upstream call, the frame sequence of a freeform
``apply_patch`` call, ``previous_response_id`` resolved on the connection, compaction,
one audit record per generating ``response.create``, the client key from the upgrade
request, and errors as the wrapped error event followed by a clean close.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai._models import validate_type
from openai.types.responses import ResponseStreamEvent
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from gateway.protocols.responses_ws import sse_data
from tests.conftest import Gateway, Simulator, start_gateway
from tests.test_audit import audit_rows

FIXTURES = Path(__file__).parent / "fixtures"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def frames(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def ws_url(gateway: Gateway) -> str:
    return gateway.url.replace("http://", "ws://") + "/v1/responses"


def open_ws(gateway: Gateway, **headers: str) -> ClientConnection:
    return connect(ws_url(gateway), additional_headers={"OpenAI-Beta": "responses_websockets=2026-02-06", **headers})


def exchange(ws: ClientConnection, frame: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one frame; the events up to the terminal (or a wrapped error), each one text frame
    holding one event that the SDK's strict models accept."""
    ws.send(json.dumps(frame))
    events: list[dict[str, Any]] = []
    while True:
        message = ws.recv(timeout=20)
        assert isinstance(message, str)
        event = json.loads(message)
        events.append(event)
        if event["type"] == "error" and "status" in event:
            return events
        validate_type(type_=ResponseStreamEvent, value=event)
        if event["type"] in TERMINAL:
            return events


def upstream_bodies(simulator: Simulator) -> list[dict[str, Any]]:
    return [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]


def test_sse_data_splits_complete_frames_only() -> None:
    buffer = bytearray(b'event: a\ndata: {"x":1}\n\nevent: b\ndata: {"y"')
    assert sse_data(buffer) == [b'{"x":1}']
    buffer += b":2}\n\n"
    assert sse_data(buffer) == [b'{"y":2}'] and buffer == b""


def test_codex_apply_patch_session_frame_sequence(gateway: Gateway, simulator: Simulator) -> None:
    prewarm, create, tool_output = frames("codex_ws_apply_patch.jsonl")
    assert prewarm["generate"] is False and create["previous_response_id"] and tool_output["previous_response_id"]
    simulator.clear()
    with open_ws(gateway) as ws:
        # permessage-deflate is negotiated (Codex asks for it; so does this client)
        assert [ext.name for ext in ws.protocol.extensions] == ["permessage-deflate"]
        warm = exchange(ws, prewarm)
        assert [e["type"] for e in warm] == ["response.created", "response.in_progress", "response.completed"]
        assert [e["sequence_number"] for e in warm] == [0, 1, 2]
        assert warm[-1]["response"]["output"] == [] and warm[-1]["response"]["id"] == warm[0]["response"]["id"]
        assert upstream_bodies(simulator) == []  # the prewarm never goes upstream

        first = exchange(ws, {**create, "previous_response_id": warm[0]["response"]["id"]})
        assert [e["sequence_number"] for e in first] == list(range(len(first)))
        kinds = [e["type"] for e in first]
        deltas = [e["delta"] for e in first if e["type"] == "response.custom_tool_call_input.delta"]
        assert deltas and kinds == [
            "response.created", "response.in_progress", "response.output_item.added",
            *["response.custom_tool_call_input.delta"] * len(deltas), "response.custom_tool_call_input.done",
            "response.output_item.done", "response.completed",
        ]
        assert first[2]["item"]["type"] == "custom_tool_call" and first[2]["item"]["input"] == ""
        [item] = first[-1]["response"]["output"]
        assert item["type"] == "custom_tool_call" and item["name"] == "apply_patch"
        assert item["input"].startswith("*** Begin Patch\n*** Add File: hello.txt")
        assert "".join(deltas) == item["input"] == first[-3]["input"]
        # the prewarm's input (the base instructions) comes first: resolved on the connection
        [sent] = upstream_bodies(simulator)
        assert sent["messages"][0]["content"] == prewarm["input"][0]["content"][0]["text"]
        assert sent["messages"][-1]["content"] == create["input"][-1]["content"][0]["text"]

        second = exchange(ws, {**tool_output, "previous_response_id": first[0]["response"]["id"]})
        assert second[-1]["type"] == "response.completed"
        [message] = second[-1]["response"]["output"]
        assert message["content"][0]["text"].startswith("Done. The tool said: Exit code: 0")
        history = upstream_bodies(simulator)[-1]["messages"]
        assert history[-2]["tool_calls"][0]["function"]["name"] == "apply_patch"
        assert history[-1]["role"] == "tool" and history[-1]["tool_call_id"] == item["call_id"]


def test_codex_compaction_over_the_socket(gateway: Gateway, simulator: Simulator) -> None:
    prewarm, create, trigger, after = frames("codex_ws_compaction.jsonl")
    assert trigger["input"][-1] == {"type": "compaction_trigger"}
    simulator.clear()
    with open_ws(gateway) as ws:
        warm = exchange(ws, prewarm)
        first = exchange(ws, {**create, "previous_response_id": warm[0]["response"]["id"]})
        assert first[-1]["response"]["output"][0]["type"] == "function_call"
        compacted = exchange(ws, {**trigger, "previous_response_id": first[0]["response"]["id"]})
        assert [e["type"] for e in compacted[2:]] == [
            "response.output_item.added", "response.output_item.done", "response.completed",
        ]
        [item] = compacted[-1]["response"]["output"]
        assert item["type"] == "compaction"
        assert upstream_bodies(simulator)[-1]["messages"][-1]["content"].startswith("Context checkpoint")
        # Codex replays the item (the fixture's own item is from another process: swap in ours)
        replay = [i if i.get("type") != "compaction" else item for i in after["input"]]
        resumed = exchange(ws, {**after, "input": replay})
        assert resumed[-1]["type"] == "response.completed"
        assert resumed[-1]["response"]["output"][0]["type"] == "function_call"  # the plan's next step
        summary = upstream_bodies(simulator)[-1]["messages"][-1]["content"]
        assert "Progress: 1 tool call(s) completed." in summary


def test_one_audit_record_per_generating_create(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, stream_mode="realtime")
    prewarm, create, tool_output = frames("codex_ws_apply_patch.jsonl")
    with open_ws(gw) as ws:
        warm = exchange(ws, prewarm)
        first = exchange(ws, {**create, "previous_response_id": warm[0]["response"]["id"]})
        exchange(ws, {**tool_output, "previous_response_id": first[0]["response"]["id"]})
    rows = audit_rows(gw, 2)
    assert len(rows) == 2
    assert {(r["protocol"], r["outcome"], r["mode"], r["streamed"]) for r in rows} == {("responses", "success", "realtime", True)}


def _closing_error(ws: ClientConnection, frame: Any) -> dict[str, Any]:
    ws.send(frame if isinstance(frame, str) else json.dumps(frame))
    error = json.loads(ws.recv(timeout=20))
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=20)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
    return error


@pytest.mark.parametrize(
    "frame,status,code",
    [
        ("{not json", 400, "invalid_json"),
        ({"type": "session.update"}, 400, "unsupported_event_type"),
        ({"type": "response.create", "model": "text", "input": "hi", "previous_response_id": "resp_unknown"}, 400, "previous_response_not_found"),
        ({"type": "response.create", "model": "text", "input": [{"type": "compaction", "encrypted_content": "x"}]}, 400, "invalid_compaction_item"),
        ({"type": "response.create", "model": "rate_limited", "input": "hi"}, 429, "upstream_rate_limited"),
    ],
)
def test_errors_are_wrapped_events_then_a_clean_close(
    gateway: Gateway, simulator: Simulator, frame: Any, status: int, code: str
) -> None:
    with open_ws(gateway) as ws:
        error = _closing_error(ws, frame)
    assert error["type"] == "error" and error["status"] == status
    assert error["error"]["code"] == code and isinstance(error["error"]["message"], str)


def test_mid_stream_failure_is_failed_then_a_clean_close(gateway: Gateway) -> None:
    with open_ws(gateway) as ws:
        events = exchange(ws, {"type": "response.create", "model": "error_frame", "input": "hi"})
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=20)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


def test_client_key_comes_from_the_upgrade_request(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, api_key=["sk-ws-client"])
    request = {"type": "response.create", "model": "text", "input": "hi"}
    for frame in (request, {**request, "generate": False}):
        with open_ws(gw) as ws:
            error = _closing_error(ws, frame)
        assert error["status"] == 401 and error["error"]["code"] == "invalid_api_key"
    with open_ws(gw, Authorization="Bearer sk-ws-client") as ws:
        events = exchange(ws, request)
        assert events[-1]["type"] == "response.completed"
        again = exchange(ws, {**request, "input": "again", "previous_response_id": events[0]["response"]["id"]})
        assert again[-1]["type"] == "response.completed"


def test_keepalives_while_the_upstream_is_silent(gateway: Gateway) -> None:
    """The session gateways keep alive every 0.5 s: a 1.5 s silent upstream yields
    repeated response.in_progress frames before the answer."""
    with open_ws(gateway) as ws:
        events = exchange(ws, {"type": "response.create", "model": "text;first_chunk_delay=1.5", "input": "hi"})
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.completed"
    first_item = kinds.index("response.output_item.added")
    assert kinds[:first_item].count("response.in_progress") >= 2


def test_client_gone_mid_answer_is_one_cancelled_record(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory)
    with open_ws(gw) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "large;first_chunk_delay=3", "input": "hi"}))
        assert json.loads(ws.recv(timeout=20))["type"] == "response.created"  # committed by a keepalive
    rows = audit_rows(gw, 1)
    assert [(r["outcome"], r["error_code"]) for r in rows] == [("cancelled", "client_disconnected")]


def test_previous_response_from_the_store(gateway: Gateway, simulator: Simulator) -> None:
    """A response stored over HTTP (``store: true``) continues on a WebSocket."""
    import httpx

    stored = httpx.post(gateway.base_url + "/responses", json={"model": "echo", "input": "first question", "store": True})
    assert stored.status_code == 200
    simulator.clear()
    with open_ws(gateway) as ws:
        events = exchange(ws, {"type": "response.create", "model": "echo", "input": "second", "previous_response_id": stored.json()["id"]})
    assert events[-1]["type"] == "response.completed"
    [sent] = upstream_bodies(simulator)
    assert [m["content"] for m in sent["messages"]] == ["first question", "You said: first question", "second"]
