"""Responses over WebSocket (``GET /v1/responses``), both modes, replaying the frames the
real Codex 0.171.0 CLI sent (tests/fixtures/codex_ws_*.jsonl: developer prompts trimmed):
the prewarm answered without an upstream call, the frame sequence of a freeform
``apply_patch`` call, ``previous_response_id`` resolved on the connection, compaction,
one audit record per generating ``response.create``, the client key from the upgrade
request, and errors as the wrapped error event followed by a clean close.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from openai._models import validate_type
from openai.types.responses import ResponseStreamEvent
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from gateway.protocols.responses.websocket_frames import MAX_QUEUED_FRAMES, Inbox, sse_data
from tests.conftest import Gateway, Simulator, start_gateway
from tests.observability.test_audit import audit_rows

FIXTURES = Path(__file__).parents[1] / "fixtures"
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


def test_a_frame_refused_before_it_is_read_as_a_request_leaves_one_record(
    server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory)
    with open_ws(gw) as ws:
        assert _closing_error(ws, "{not json")["error"]["code"] == "invalid_json"
    with open_ws(gw) as ws:
        assert _closing_error(ws, {"type": "session.update"})["error"]["code"] == "unsupported_event_type"
    rows = audit_rows(gw, 2)
    assert sorted((r["protocol"], r["outcome"], r["error_code"], r["http_status"], r["transport"]) for r in rows) == [
        ("responses", "invalid", "invalid_json", 400, "websocket"),
        ("responses", "invalid", "unsupported_event_type", 400, "websocket"),
    ]


def test_mid_stream_failure_is_failed_then_a_clean_close(gateway: Gateway) -> None:
    with open_ws(gateway) as ws:
        events = exchange(ws, {"type": "response.create", "model": "error_frame", "input": "hi"})
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=20)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


def test_client_key_comes_from_the_upgrade_request(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The key is checked on the upgrade headers, before the socket is accepted: without it
    (or with a wrong one) the upgrade is a 401 with the OpenAI error body, no socket, no
    slot and no audit record (no frame was read: no generation request)."""
    from websockets.exceptions import InvalidStatus

    key = "sk-ws-client-0123456789abcdef"
    gw = start_gateway(server_loop, simulator, tmp_path_factory, api_key=[key])
    request = {"type": "response.create", "model": "text", "input": "hi"}
    for headers in ({}, {"Authorization": "Bearer sk-wrong-0123456789abcdefghij"}, {"x-api-key": key[:-1]}):
        with pytest.raises(InvalidStatus) as refused:
            open_ws(gw, **headers)
        response = refused.value.response
        assert response.status_code == 401 and response.headers["Content-Type"] == "application/json"
        assert json.loads(response.body)["error"] == {
            "message": "a valid API key is required (Authorization: Bearer or x-api-key)",
            "type": "authentication_error", "param": None, "code": "invalid_api_key",
        }
    assert _open_websockets(gw) == (0, 0)  # refused before a slot was taken
    with open_ws(gw, Authorization=f"Bearer {key}") as ws:  # with the key: what was wrong with the frame
        assert _closing_error(ws, "{not json")["error"]["code"] == "invalid_json"
    with open_ws(gw, **{"x-api-key": key}) as ws:
        events = exchange(ws, request)
        assert events[-1]["type"] == "response.completed"
        again = exchange(ws, {**request, "input": "again", "previous_response_id": events[0]["response"]["id"]})
        assert again[-1]["type"] == "response.completed"
    rows = audit_rows(gw, 3)  # the unread frame and the two generating requests; no refused upgrade
    assert sorted((r["outcome"], r["error_code"] or "", r["transport"]) for r in rows) == [
        ("invalid", "invalid_json", "websocket"), ("success", "", "websocket"), ("success", "", "websocket"),
    ]


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_keepalives_while_the_upstream_is_silent(keepalive_gateways: dict[str, Gateway], mode: str) -> None:
    """Keeping alive every 0.5 s, an 8 s silent upstream yields repeated
    response.in_progress frames before the answer (8 s: a loaded machine fires the loop's
    timers late; 4 s saw one keepalive of the Chat twin at load 19)."""
    with open_ws(keepalive_gateways[mode]) as ws:
        events = exchange(ws, {"type": "response.create", "model": "text;first_chunk_delay=8", "input": "hi"})
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


# -- bounds: a hostile client cannot grow the gateway's memory --------------------------------

SLOW = {"type": "response.create", "model": "large;first_chunk_delay=5", "input": "hi"}
QUICK = {"type": "response.create", "model": "text", "input": "hi"}


def _refusal(ws: ClientConnection, timeout: float = 20) -> tuple[dict[str, Any], int]:
    """Read up to the wrapped error (within the first response's few events); the close
    code that followed it."""
    for _ in range(50):
        event = json.loads(ws.recv(timeout=timeout))
        if event["type"] == "error" and "status" in event:
            break
    else:
        pytest.fail("no wrapped error: the frames were answered")
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=timeout)
    assert closed.value.rcvd is not None
    return event, closed.value.rcvd.code


def _flood(ws: ClientConnection, frames: Iterable[str]) -> int:
    """Send frames until the server closes; how many went out."""
    sent = 0
    for frame in frames:
        try:
            ws.send(frame)
        except ConnectionClosed:
            break
        sent += 1
    return sent


def test_inbox_bounds_frames_and_bytes() -> None:
    inbox = Inbox(max_frames=2, max_bytes=10)
    assert inbox.offer({"type": "websocket.receive", "text": "é" * 3}) is None  # 6 bytes of UTF-8
    assert inbox.bytes == 6
    over_bytes = inbox.offer({"type": "websocket.receive", "bytes": b"12345"})
    assert over_bytes is not None and over_bytes.close_code == 1008
    assert over_bytes.error.code == "too_many_queued_frames" and inbox.bytes == 6
    assert inbox.offer({"type": "websocket.receive", "text": "abcd"}) is None
    over_count = inbox.offer({"type": "websocket.receive", "text": ""})
    assert over_count is not None and over_count.close_code == 1008 and len(inbox.frames) == 2
    assert inbox.take() == ({"type": "websocket.receive", "text": "é" * 3}, 6) and inbox.bytes == 4
    too_big = Inbox(max_frames=2, max_bytes=10).offer({"type": "websocket.receive", "text": "x" * 11})
    assert too_big is not None and too_big.close_code == 1009 and too_big.error.status == 413


def test_a_flood_while_answering_is_refused_and_the_gateway_serves_on(
    server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory)
    simulator.clear()
    # the first answer's first chunk comes after 60 s (it is cut by the close long before):
    # the flood is refused while it is in flight however slowly a busy machine reads (#39)
    slow = {**SLOW, "model": "large;first_chunk_delay=60"}
    limit = 1_000_000  # more than any socket buffers hold: the close is what ends the flood
    with open_ws(gw) as ws:
        ws.send(json.dumps(slow))
        assert json.loads(ws.recv(timeout=60))["type"] == "response.created"  # in flight: a keepalive
        flood = (json.dumps({**QUICK, "input": f"flood {i}"}) for i in range(limit))
        sent = _flood(ws, flood)
        error, code = _refusal(ws, 60)
    assert MAX_QUEUED_FRAMES < sent < limit  # the server closed mid-flood
    assert code == 1008
    assert error["status"] == 400 and error["error"]["code"] == "too_many_queued_frames"
    # nothing queued was answered: only the first request ever went upstream
    assert [b["messages"][-1]["content"] for b in upstream_bodies(simulator)] == ["hi"]
    rows = audit_rows(gw, 2, 30)  # the answer cut, and the refusal itself (one record, not one per frame)
    assert sorted((r["outcome"], r["error_code"], r["model"] or "", r["transport"]) for r in rows) == [
        ("cancelled", "client_disconnected", "large;first_chunk_delay=60", "websocket"),
        ("invalid", "too_many_queued_frames", "", "websocket"),
    ]
    # the gateway serves on: a new connection, and plain HTTP
    with open_ws(gw) as ws:
        assert exchange(ws, QUICK)[-1]["type"] == "response.completed"
    import httpx

    assert httpx.post(gw.base_url + "/responses", json={"model": "text", "input": "hi"}).json()["status"] == "completed"


def test_pipelined_requests_within_the_bound_are_answered_in_order(gateway: Gateway) -> None:
    with open_ws(gateway) as ws:
        for i in range(3):
            ws.send(json.dumps({**QUICK, "model": "echo", "input": f"question {i}"}))
        answers = []
        for _ in range(3):
            events = []
            while not events or events[-1]["type"] not in TERMINAL:
                events.append(json.loads(ws.recv(timeout=20)))
            answers.append(events[-1]["response"]["output"][0]["content"][0]["text"])
    assert answers == [f"You said: question {i}" for i in range(3)]


def test_queued_bytes_past_max_body_bytes_are_refused(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, max_body_bytes=4096)
    with open_ws(gw) as ws:
        ws.send(json.dumps(SLOW))
        assert json.loads(ws.recv(timeout=20))["type"] == "response.created"
        ws.send(json.dumps({**QUICK, "input": "a" * 3000}))  # fits alone
        ws.send(json.dumps({**QUICK, "input": "b" * 3000}))  # 6000 queued bytes > 4096
        error, code = _refusal(ws)
    assert code == 1008 and error["error"]["code"] == "too_many_queued_frames"


def test_a_frame_over_max_body_bytes_is_413_then_close_1009(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, max_body_bytes=4096)
    with open_ws(gw) as ws:
        ws.send(json.dumps({**QUICK, "input": "x" * 5000}))
        error, code = _refusal(ws)
    assert code == 1009
    assert error["status"] == 413 and error["error"]["code"] == "request_too_large"
    rows = audit_rows(gw, 1)  # audited like a body over the limit on HTTP
    assert [(r["outcome"], r["error_code"], r["http_status"], r["transport"]) for r in rows] == [
        ("invalid", "request_too_large", 413, "websocket"),
    ]
    with open_ws(gw) as ws:  # a frame within the limit on a new connection is answered
        assert exchange(ws, {**QUICK, "input": "x" * 3000})[-1]["type"] == "response.completed"


def test_uvicorn_refuses_a_frame_past_the_slack_before_buffering_it(tmp_path: Path, simulator: Simulator) -> None:
    """As ``serve`` runs it (``websocket_options``): within the slack the app answers the
    wrapped 413; past it uvicorn closes 1009 from the frame header."""
    from gateway.app import create_app
    from gateway.cli import WS_FRAME_SLACK, websocket_options
    from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
    from gateway.settings import Settings
    from tests.conftest import ServerLoop

    settings = Settings(upstream_url=[simulator.url + "/v1"], data_dir=tmp_path, max_body_bytes=4096, spill_max_bytes=1 << 20)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    loop = ServerLoop()
    sock = bind_loopback()
    server = loop.run(start_embedded(app, sock, **websocket_options(settings)))
    try:
        gw = Gateway(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
        with open_ws(gw) as ws:
            ws.send(json.dumps({**QUICK, "input": "x" * (4096 + WS_FRAME_SLACK // 2)}))
            error, code = _refusal(ws)
        assert code == 1009 and error["error"]["code"] == "request_too_large"
        with open_ws(gw) as ws:
            ws.send(json.dumps({**QUICK, "input": "x" * (4096 + WS_FRAME_SLACK)}))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=20)  # no error frame: the server refused the frame itself
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    finally:
        loop.run(stop_embedded(*server))
        loop.close()


def test_an_idle_connection_is_closed_but_a_long_answer_is_not_cut(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(server_loop, simulator, tmp_path_factory, ws_idle_timeout=0.5)
    with open_ws(gw) as ws:
        # the answer takes longer than the idle timeout: idle means nothing in flight
        events = exchange(ws, {**QUICK, "model": "text;first_chunk_delay=1.5"})
        assert events[-1]["type"] == "response.completed"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=20)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "idle timeout")


def test_the_audit_record_names_the_transport(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    import httpx

    gw = start_gateway(server_loop, simulator, tmp_path_factory)
    with open_ws(gw) as ws:
        over_ws = exchange(ws, QUICK)[-1]["response"]["id"]
    over_http = httpx.post(gw.base_url + "/responses", json={"model": "text", "input": "hi"})
    rows = audit_rows(gw, 2)
    assert sorted((r["protocol"], r["transport"], r["outcome"]) for r in rows) == [
        ("responses", "http", "success"), ("responses", "websocket", "success"),
    ]
    by_transport = {r["transport"]: r["request_id"] for r in rows}
    assert by_transport["http"] == over_http.headers["x-request-id"]
    detail = httpx.get(f"{gw.url}/admin/api/audit/{by_transport['websocket']}", headers=gw.admin).json()
    assert detail["transport"] == "websocket" and detail["protocol"] == "responses" and over_ws.startswith("resp_")


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_the_admin_audit_api_filters_by_transport(
    request: pytest.FixtureRequest, server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, store: str
) -> None:
    """``GET /admin/api/audit?transport=...`` on both stores, combined with the other filters."""
    import httpx

    url = request.getfixturevalue("postgres_schema") if store == "postgres" else None
    gw = start_gateway(server_loop, simulator, tmp_path_factory, database_url=url)
    with open_ws(gw) as ws:
        exchange(ws, QUICK)
        exchange(ws, {**QUICK, "model": "echo"})
    over_http = httpx.post(gw.base_url + "/responses", json={"model": "text", "input": "hi"})
    rows = audit_rows(gw, 3)
    by_transport: dict[str, list[str]] = {}
    for row in rows:
        by_transport.setdefault(row["transport"], []).append(row["request_id"])
    assert by_transport["http"] == [over_http.headers["x-request-id"]] and len(by_transport["websocket"]) == 2

    def listed(**params: str) -> list[str]:
        page = httpx.get(gw.url + "/admin/api/audit", params=params, headers=gw.admin).json()
        assert page["total"] == len(page["data"])
        return sorted(r["request_id"] for r in page["data"])

    assert listed(transport="websocket") == sorted(by_transport["websocket"])
    assert listed(transport="http") == by_transport["http"]
    assert listed(transport="websocket", model="echo") == [r["request_id"] for r in rows if r["model"] == "echo"]
    assert listed(transport="http", model="echo") == []
    assert listed(transport="smoke-signals") == []


def test_connection_memory_is_bounded_in_bytes_and_keeps_the_newest() -> None:
    from gateway.protocols.responses.websocket import ConnectionMemory

    memory = ConnectionMemory(max_bytes=1000, max_count=3)
    memory.put("a", b"a" * 400)
    memory.put("b", b"b" * 500)
    assert memory.bytes == 900 and list(memory.blobs) == ["a", "b"]
    memory.put("c", b"c" * 300)  # 1200 > 1000: the oldest goes
    assert list(memory.blobs) == ["b", "c"] and memory.bytes == 800
    memory.put("c", b"C" * 100)  # the same id again replaces its bytes
    assert memory.bytes == 600 and memory.get("c") == b"C" * 100
    memory.put("d", b"d"), memory.put("e", b"e")  # past max_count
    assert list(memory.blobs) == ["c", "d", "e"]
    memory.put("f", b"f" * 5000)  # alone over the budget: kept, the rest goes
    assert list(memory.blobs) == ["f"] and memory.bytes == 5000 and memory.get("a") is None


def test_a_remembered_conversation_is_packed_and_bounded_when_inflated() -> None:
    from gateway.protocols.responses.websocket import pack, unpack

    record = {"response": {"id": "resp_1"}, "history": [{"role": "user", "content": "x"}] * 100_000, "output": []}
    blob = pack(record, max_json_bytes=10 * 1024 * 1024)
    assert blob is not None and len(blob) < 50_000 < len(orjson_dumps(record))  # 3.1 MB of JSON
    assert unpack(blob, 10 * 1024 * 1024) == record
    assert pack(record, max_json_bytes=1024 * 1024) is None  # over the bound: not remembered
    with pytest.raises(ValueError):
        unpack(blob, 1024 * 1024)  # never inflated past the bound


def orjson_dumps(value: Any) -> bytes:
    import orjson

    return orjson.dumps(value)


def test_a_connection_forgets_its_oldest_conversations_past_the_byte_budget(
    server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--max-body-bytes 4096: a connection keeps about 4 KiB of packed conversations (random
    text does not compress); the newest continues, the oldest is gone (previous_response_not_found)."""
    import secrets

    gw = start_gateway(server_loop, simulator, tmp_path_factory, max_body_bytes=4096)
    with open_ws(gw) as ws:
        ids = [exchange(ws, {**QUICK, "generate": False, "input": secrets.token_urlsafe(2200)})[0]["response"]["id"]
               for _ in range(3)]
        assert exchange(ws, {**QUICK, "model": "echo", "input": "next", "previous_response_id": ids[-1]})[-1]["type"] == "response.completed"
        error = _closing_error(ws, {**QUICK, "previous_response_id": ids[0]})
    assert error["status"] == 400 and error["error"]["code"] == "previous_response_not_found"


def test_ignored_frames_do_not_extend_the_idle_timeout(server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``response.processed`` every 0.2 s (the gateway answers nothing to it) does not keep a
    socket with --ws-idle-timeout 1 open: it closes 1000 "idle timeout" about a second after
    its last answer."""
    import time

    gw = start_gateway(server_loop, simulator, tmp_path_factory, ws_idle_timeout=1.0)
    with open_ws(gw) as ws:
        assert exchange(ws, QUICK)[-1]["type"] == "response.completed"
        answered = time.monotonic()
        with pytest.raises(ConnectionClosed) as closed:
            for _ in range(100):  # 20 s of them, were they enough
                ws.send(json.dumps({"type": "response.processed", "response_id": "resp_x"}))
                time.sleep(0.2)
        lasted = time.monotonic() - answered
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "idle timeout")
    assert lasted < 10  # closed on the idle timeout, not at the end of the frames


# -- connections: how many at once, how long each ---------------------------------------------


def _open_websockets(gw: Gateway) -> tuple[float, float]:
    """(open now, upgrades refused so far) from /metrics."""
    from tests.observability.test_audit import scrape, total

    samples = scrape(gw.url)
    return (total(samples, "codebuddy2api_websockets_open"),
            total(samples, "codebuddy2api_websocket_upgrades_refused_total"))


def _wait_open(gw: Gateway, count: float) -> None:
    from tests.conftest import wait_for

    wait_for(lambda: _open_websockets(gw)[0] == count, timeout=10)


def test_connection_slots_count_refusals() -> None:
    from gateway.protocols.responses.websocket_slots import ConnectionSlots

    seen: list[int] = []
    refused: list[bool] = []
    slots = ConnectionSlots(seen.append, lambda: refused.append(True))
    assert slots.take(2) and slots.take(2) and not slots.take(2)
    assert (slots.open, seen, refused) == (2, [1, 2], [True])
    slots.give_back()
    assert slots.take(2) and not slots.take(1)  # the limit is read per upgrade (live settings)
    assert seen == [1, 2, 1, 2] and refused == [True, True]


def test_past_max_connections_the_upgrade_is_a_503_with_the_openai_error_body(
    server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The N+1th upgrade is refused before it is accepted (an HTTP answer, no WebSocket):
    503, Retry-After and ``too_many_websockets``; closing one frees its slot; the refusal
    is counted and is no generation request (no audit record)."""
    from contextlib import ExitStack

    from websockets.exceptions import InvalidStatus

    gw = start_gateway(server_loop, simulator, tmp_path_factory, ws_max_connections=2)
    with ExitStack() as opened:
        first, second = opened.enter_context(open_ws(gw)), opened.enter_context(open_ws(gw))
        _wait_open(gw, 2)
        with pytest.raises(InvalidStatus) as refused:
            open_ws(gw)
        response = refused.value.response
        assert response.status_code == 503 and response.headers["Retry-After"] == "5"
        assert response.headers["Content-Type"] == "application/json"
        body = json.loads(response.body)
        assert body == {"error": {
            "message": "the gateway has its limit of 2 Responses WebSocket connections open: retry later"
                       " (or send the request as POST /v1/responses)",
            "type": "server_error", "param": None, "code": "too_many_websockets",
        }}
        assert _open_websockets(gw) == (2, 1)
        assert exchange(second, QUICK)[-1]["type"] == "response.completed"  # the open ones serve on
        first.close()
        _wait_open(gw, 1)
        with open_ws(gw) as third:  # the freed slot
            assert exchange(third, {**QUICK, "model": "echo"})[-1]["type"] == "response.completed"
            with pytest.raises(InvalidStatus):
                open_ws(gw)  # full again
        assert _open_websockets(gw)[1] == 2
    _wait_open(gw, 0)
    rows = audit_rows(gw, 2)
    assert sorted((r["outcome"], r["model"]) for r in rows) == [("success", "echo"), ("success", "text")]


def test_without_the_denial_extension_the_refusal_is_close_1013() -> None:
    """A server without ASGI's ``websocket.http.response``: accepted, then closed 1013
    (try again later) with the message as the reason."""
    import asyncio

    from starlette.websockets import WebSocket

    from gateway.protocols.responses.room import ResponsesRoom
    from gateway.protocols.responses.websocket import refuse_upgrade, too_many_websockets

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/responses", "headers": [], "query_string": b""}
    asyncio.run(refuse_upgrade(WebSocket(scope, receive, send), ResponsesRoom(None), too_many_websockets(3)))  # type: ignore[arg-type]
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.close"]
    assert sent[1]["code"] == 1013 and sent[1]["reason"].startswith("the gateway has its limit of 3 Responses WebSocket")
    assert len(sent[1]["reason"].encode()) <= 123


def test_past_max_lifetime_the_connection_closes_after_its_answer_and_the_sdk_reconnects(
    server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--ws-max-lifetime 1: an answer taking longer is never cut (assembled whole); right
    after it the connection is closed 1001, which the official SDK's ``responses.connect``
    treats as recoverable: it reconnects, and the next request is answered there.

    The second request is sent from ``on_reconnecting``: the SDK queues a send made while it
    reconnects and flushes it the moment the new connection opens, so it reaches the gateway well
    inside that connection's own 1 s lifetime (a thread sending "after the reconnect" could come
    later than that on a loaded machine and find the idle new connection closed too)."""
    import openai

    gw = start_gateway(server_loop, simulator, tmp_path_factory, ws_max_lifetime=1.0, ws_idle_timeout=60)
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused", _strict_response_validation=True)
    reconnects: list[int] = []

    def on_reconnecting(event: Any) -> None:
        reconnects.append(event.close_code)
        if len(reconnects) == 1:
            conn.response.create(model="echo", input="after the reconnect")

    answers: list[tuple[str, str]] = []
    with client.responses.connect(on_reconnecting=on_reconnecting, initial_delay=0.05) as conn:
        conn.response.create(model="text;first_chunk_delay=1.5", input="outlive the lifetime")
        deltas: list[str] = []
        for event in conn:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                answers.append(("".join(deltas), event.response.output_text))
                deltas = []
                if len(answers) == 2:
                    break
    (streamed, final), (streamed_again, echoed) = answers
    assert streamed == final and len(final) > 20  # the answer that outlived the lifetime, whole
    assert echoed == streamed_again == "You said: after the reconnect"
    assert reconnects == [1001]
    rows = audit_rows(gw, 2)
    assert sorted((r["outcome"], r["transport"], r["model"]) for r in rows) == [
        ("success", "websocket", "echo"), ("success", "websocket", "text;first_chunk_delay=1.5"),
    ]


def test_an_idle_connection_past_its_lifetime_is_closed_1001(
    server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Nothing in flight: the lifetime closes it even though the idle timeout is far off;
    its slot (and the gauge) goes back."""
    gw = start_gateway(server_loop, simulator, tmp_path_factory, ws_max_lifetime=0.5, ws_idle_timeout=60)
    with open_ws(gw) as ws:
        assert exchange(ws, QUICK)[-1]["type"] == "response.completed"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=20)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "max lifetime reached: reconnect")
    _wait_open(gw, 0)


def test_keyless_sockets_cannot_take_a_slot_and_each_address_has_its_cap(
    server_loop: Any, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With --api-key and 2 slots: 50 upgrades without the key are 401s that hold nothing; the
    Codex-style client with the key still connects. --ws-max-connections-per-ip 1: a second
    socket from the same address is a 503 naming the per-address limit, the first serves on."""
    from websockets.exceptions import InvalidStatus

    key = "sk-ws-slots-0123456789abcdef"
    gw = start_gateway(server_loop, simulator, tmp_path_factory, api_key=[key], ws_max_connections=2,
                       ws_max_connections_per_ip=1)
    for _ in range(50):
        with pytest.raises(InvalidStatus) as refused:
            open_ws(gw)
        assert refused.value.response.status_code == 401
    assert _open_websockets(gw) == (0, 0)
    with open_ws(gw, Authorization=f"Bearer {key}") as ws:
        _wait_open(gw, 1)
        with pytest.raises(InvalidStatus) as refused:
            open_ws(gw, Authorization=f"Bearer {key}")
        response = refused.value.response
        assert response.status_code == 503 and response.headers["Retry-After"] == "5"
        assert json.loads(response.body)["error"]["message"].startswith(
            "the gateway has its limit of 1 Responses WebSocket connections from your address")
        assert exchange(ws, QUICK)[-1]["type"] == "response.completed"
    _wait_open(gw, 0)
    assert _open_websockets(gw)[1] == 1
