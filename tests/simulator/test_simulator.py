"""The scripted upstream must reproduce real-upstream quirks exactly, over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from gateway.simulator.server import (
    assemble_completion,
    build_frames,
    create_simulator_app,
    make_simulator_server,
    parse_model,
    scenario_names,
)

MESSAGES = [{"role": "user", "content": "ping"}]
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = make_simulator_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not server.started:
        assert time.monotonic() < deadline, "simulator did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{url}/healthz").json() == {"ok": True}
    yield url
    server.should_exit = True
    thread.join(5)


@pytest.fixture()
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=5) as c:
        yield c


def stream(client: httpx.Client, model: str, **extra: Any) -> list[str]:
    """Raw SSE data payloads for one streamed request."""
    body = {"model": model, "messages": MESSAGES, "stream": True, **extra}
    with connect_sse(client, "POST", "/v1/chat/completions", json=body) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return [event.data for event in source.iter_sse()]


def chunks(data: list[str]) -> list[dict[str, Any]]:
    return [json.loads(d) for d in data if d != "[DONE]"]


def tool_entries(cs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [tc for c in cs for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []]


def text_of(cs: list[dict[str, Any]], key: str = "content") -> str:
    return "".join(ch["delta"].get(key) or "" for c in cs for ch in c["choices"])


def finishes(cs: list[dict[str, Any]]) -> list[str]:
    return [ch["finish_reason"] for c in cs for ch in c["choices"] if ch["finish_reason"]]


def arguments(client: httpx.Client, model: str) -> str:
    return "".join(e["function"]["arguments"] for e in tool_entries(chunks(stream(client, model))))


def post(client: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    """One non-streaming (unless overridden) chat completions request."""
    return client.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, **extra})


def test_models_and_health(client: httpx.Client) -> None:
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert {"echo", "parallel_tools", "rate_limited", "drop"} <= set(ids)
    assert ids == scenario_names()


def test_echo_stream_shape(client: httpx.Client) -> None:
    data = stream(client, "gpt-4o;chunk=3")
    assert data[-1] == "[DONE]"
    cs = chunks(data)
    assert all(c["object"] == "chat.completion.chunk" for c in cs)
    assert all(c["model"] == "gpt-4o;chunk=3" for c in cs)
    assert len({c["id"] for c in cs}) == 1 and all(isinstance(c["created"], int) for c in cs)
    assert cs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(len(ch["delta"].get("content", "")) <= 3 for c in cs for ch in c["choices"])
    assert text_of(cs) == "You said: ping"
    assert cs[-1]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert not any("usage" in c for c in cs)


def test_echo_handles_content_parts(client: httpx.Client) -> None:
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parts = [{"role": "user", "content": content}]
    assert text_of(chunks(stream(client, "echo", messages=parts))) == "You said: ab"


def test_usage_modes(client: httpx.Client) -> None:
    with_usage = {"stream_options": {"include_usage": True}}
    cs = chunks(stream(client, "text", **with_usage))
    assert cs[-1]["choices"] == [] and cs[-1]["usage"]["total_tokens"] > 0
    assert cs[-2]["choices"][0]["finish_reason"] == "stop"
    last = chunks(stream(client, "text;usage=last"))
    assert last[-1]["choices"][0]["finish_reason"] == "stop" and "usage" in last[-1]
    assert not any("usage" in c for c in chunks(stream(client, "text;usage=none", **with_usage)))
    merged = chunks(stream(client, "text;finish_chunk=last"))
    assert merged[-1]["choices"][0]["delta"]["content"] and finishes(merged) == ["stop"]


def test_reasoning_before_content(client: httpx.Client) -> None:
    cs = chunks(stream(client, "reasoning", stream_options={"include_usage": True}))
    keys = [k for c in cs for ch in c["choices"] for k in ch["delta"] if k != "role"]
    assert keys.index("content") > max(i for i, k in enumerate(keys) if k == "reasoning_content")
    assert cs[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    field = chunks(stream(client, "reasoning_field"))
    assert text_of(field, "reasoning") and not text_of(field, "reasoning_content")


def test_single_tool_uses_declared_name(client: httpx.Client) -> None:
    entries = tool_entries(chunks(stream(client, "tool", tools=TOOLS)))
    assert entries[0] == {"index": 0, "id": "call_sim_0", "type": "function",
                          "function": {"name": "lookup", "arguments": ""}}
    assert all(set(e) == {"index", "function"} for e in entries[1:])
    assert all(set(e["function"]) == {"arguments"} for e in entries[1:])
    args = "".join(e["function"]["arguments"] for e in entries)
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
    assert tool_entries(chunks(stream(client, "tool")))[0]["function"]["name"] == "get_weather"


def test_text_then_tool(client: httpx.Client) -> None:
    cs = chunks(stream(client, "text_then_tool"))
    assert text_of(cs) and tool_entries(cs) and finishes(cs) == ["tool_calls"]


def test_parallel_and_interleaved_order(client: httpx.Client) -> None:
    par = tool_entries(chunks(stream(client, "parallel_tools", tools=TOOLS[:1])))
    order = [e["index"] for e in par]
    assert order == sorted(order) and set(order) == {0, 1}
    assert [e["function"]["name"] for e in par if "id" in e] == ["lookup", "lookup"]
    inter = tool_entries(chunks(stream(client, "interleaved_tools;chunk=4")))
    assert [e["index"] for e in inter[:2]] == [0, 1] and all("id" in e for e in inter[:2])
    assert [e["index"] for e in inter[2:6]] == [0, 1, 0, 1]


def test_missing_index(client: httpx.Client) -> None:
    entries = tool_entries(chunks(stream(client, "missing_index")))
    assert all("index" not in e for e in entries)
    starts = [i for i, e in enumerate(entries) if "id" in e]
    assert len(starts) == 2 and starts[0] == 0
    assert all("id" not in e for i, e in enumerate(entries) if i not in starts)


def test_repeated_id_and_late_name(client: httpx.Client) -> None:
    rep = tool_entries(chunks(stream(client, "repeated_id")))
    assert len(rep) > 2
    assert all(e["index"] == 0 and e["id"] == "call_sim_0" and e["type"] == "function"
               and e["function"]["name"] == "get_weather" for e in rep)
    late = tool_entries(chunks(stream(client, "late_name")))
    assert "name" not in late[0]["function"] and late[0]["id"] == "call_sim_0"
    assert late[0]["function"]["arguments"] and late[1]["function"]["name"] == "get_weather"


def test_identity_change_and_undeclared(client: httpx.Client) -> None:
    ids = [e.get("id") for e in tool_entries(chunks(stream(client, "identity_change")))]
    assert ids[:3] == ["call_sim_0", None, "call_sim_changed"]
    undeclared = tool_entries(chunks(stream(client, "undeclared_tool", tools=TOOLS)))
    assert undeclared[0]["function"]["name"] == "not_a_declared_tool"


def test_malformed_arguments(client: httpx.Client) -> None:
    with pytest.raises(ValueError):
        json.loads(arguments(client, "invalid_json"))
    fenced = arguments(client, "fenced_json")
    assert fenced.startswith("```json\n") and fenced.endswith("\n```")
    deltas = [c["choices"][0]["delta"] for c in chunks(stream(client, "empty_tool_array"))]
    assert all(d["tool_calls"] == [] for d in deltas if d.get("content"))


@pytest.mark.parametrize(
    ("model", "finish", "has_text"),
    [
        ("content_filter", "content_filter", False),
        ("content_filter_partial", "content_filter", True),
        ("length", "length", True),
    ],
)
def test_finish_reasons(client: httpx.Client, model: str, finish: str, has_text: bool) -> None:
    data = stream(client, model)
    cs = chunks(data)
    assert finishes(cs) == [finish] and bool(text_of(cs)) is has_text and data[-1] == "[DONE]"


def test_stream_endings(client: httpx.Client) -> None:
    no_done = stream(client, "no_done")
    assert "[DONE]" not in no_done and finishes(chunks(no_done)) == ["stop"]
    no_finish = stream(client, "no_finish")
    assert no_finish[-1] == "[DONE]" and finishes(chunks(no_finish)) == []
    assert "[DONE]" not in stream(client, "text;done=0")
    err = stream(client, "error_frame")
    assert json.loads(err[-1]) == {"error": {"message": "upstream exploded", "type": "server_error",
                                             "code": "internal_error"}}
    assert "[DONE]" not in err and finishes(chunks(err[:-1])) == []


def test_drop_is_a_client_side_error(client: httpx.Client) -> None:
    received: list[str] = []
    body = {"model": "drop", "messages": MESSAGES, "stream": True}
    with pytest.raises(httpx.RemoteProtocolError):
        with connect_sse(client, "POST", "/v1/chat/completions", json=body) as source:
            received.extend(e.data for e in source.iter_sse())
    assert received and "[DONE]" not in received
    with pytest.raises(httpx.RemoteProtocolError):
        post(client, "drop")


@pytest.mark.parametrize(
    ("model", "status"),
    [("rate_limited", 429), ("unauthorized", 401), ("server_error", 500), ("unavailable", 503),
     ("http_error", 500), ("http_error;status=418", 418)],
)
def test_http_errors(client: httpx.Client, model: str, status: int) -> None:
    resp = post(client, model, stream=True)
    assert resp.status_code == status
    assert set(resp.json()["error"]) >= {"message", "type", "code"}
    assert ("retry-after" in resp.headers) is (status == 429)
    if status == 429:
        assert resp.headers["retry-after"] == "7"


def test_retry_after_option(client: httpx.Client) -> None:
    resp = post(client, "rate_limited;retry_after=2")
    assert resp.status_code == 429 and resp.headers["retry-after"] == "2"


@pytest.mark.parametrize(
    "model",
    ["text", "reasoning", "parallel_tools", "missing_index", "late_name", "identity_change",
     "content_filter", "gpt-4o"],
)
def test_non_stream_matches_stream(client: httpx.Client, model: str) -> None:
    usage = {"stream_options": {"include_usage": True}}
    streamed = stream(client, model, tools=TOOLS, **usage)
    expected = assemble_completion([json.loads(d) for d in streamed if d != "[DONE]"], model)
    resp = post(client, model, tools=TOOLS)
    got = resp.json()
    assert resp.status_code == 200 and got["object"] == "chat.completion"
    assert got["choices"] == expected["choices"] and got["usage"] == expected["usage"]
    if model == "parallel_tools":
        calls = got["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [
            {"city": "Paris", "unit": "celsius"}, {"timezone": "Europe/Paris"}]


def test_non_stream_error_frame_is_http_error(client: httpx.Client) -> None:
    resp = post(client, "error_frame")
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "upstream exploded"


def test_unstable_id(client: httpx.Client) -> None:
    cs = chunks(stream(client, "text;unstable_id=1"))
    assert len({c["id"] for c in cs}) == len(cs)


def test_large(client: httpx.Client) -> None:
    cs = chunks(stream(client, "large;size=5000"))
    pieces = [ch["delta"].get("content", "") for c in cs for ch in c["choices"]]
    assert len("".join(pieces).encode()) == 5000 and max(map(len, pieces)) == 256


def test_timing_options_and_flush(client: httpx.Client) -> None:
    body = {"model": "slow_first_byte;ttfb=0.3", "messages": MESSAGES, "stream": True}
    start = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert time.monotonic() - start >= 0.3
        resp.read()
    body = {"model": "text;chunk=40;delay=0.15", "messages": MESSAGES, "stream": True}
    start = time.monotonic()
    with connect_sse(client, "POST", "/v1/chat/completions", json=body) as source:
        events = source.iter_sse()
        next(events)
        first_at = time.monotonic() - start
        list(events)
        total = time.monotonic() - start
    assert first_at < 0.12 and total >= 0.3  # frames arrive one by one, not batched


def test_script_round_trip(client: httpx.Client) -> None:
    frames = [
        {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
        {"_op": "sleep", "seconds": 0.01},
        {"_op": "raw", "data": "not json at all"},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"_op": "done"},
    ]
    script_id = client.post("/_sim/scripts", json={"frames": frames}).json()["id"]
    data = stream(client, f"script:{script_id}")
    assert data[1] == "not json at all" and data[-1] == "[DONE]" and len(data) == 4
    first = json.loads(data[0])
    assert first["model"] == f"script:{script_id}" and first["choices"] == frames[0]["choices"]
    assert first["object"] == "chat.completion.chunk" and first["id"]
    plain = post(client, f"script:{script_id}").json()
    assert plain["choices"][0]["message"]["content"] == "hi" and "usage" not in plain
    spec = {"frames": [{"error": {"message": "x"}}], "status": 400, "headers": {"x-sim": "1"}}
    failing = client.post("/_sim/scripts", json=spec).json()["id"]
    resp = post(client, f"script:{failing}", stream=True)
    assert resp.status_code == 400 and resp.headers["x-sim"] == "1"
    assert resp.json() == {"error": {"message": "x"}}
    assert post(client, "script:nope").status_code == 404


def test_script_drop_and_validation(client: httpx.Client) -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    frames = [chunk, {"_op": "drop"}]
    script_id = client.post("/_sim/scripts", json={"frames": frames}).json()["id"]
    with pytest.raises(httpx.RemoteProtocolError):
        stream(client, f"script:{script_id}")
    assert client.post("/_sim/scripts", json={"frames": "nope"}).status_code == 400


def test_request_log(client: httpx.Client) -> None:
    assert client.delete("/_sim/requests").status_code == 200
    client.post("/v1/chat/completions", json={"model": "echo", "messages": MESSAGES},
                headers={"Authorization": "Bearer sk-secret"})
    post(client, "echo")
    log = client.get("/_sim/requests")
    assert "sk-secret" not in log.text
    entries = log.json()["requests"]
    assert [e["has_authorization"] for e in entries] == [True, False]
    assert entries[0]["body"]["model"] == "echo" and entries[0]["path"] == "/v1/chat/completions"
    assert isinstance(entries[0]["at"], float)
    client.delete("/_sim/requests")
    assert client.get("/_sim/requests").json() == {"requests": []}
    assert create_simulator_app().state.sim.requests.maxlen == 500


def test_bad_requests(client: httpx.Client) -> None:
    assert client.post("/v1/chat/completions", content=b"{nope").status_code == 400
    resp = post(client, "text;chunk=abc")
    assert resp.status_code == 400 and "chunk=abc" in resp.json()["error"]["message"]


def wait_for(client: httpx.Client, predicate: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 3
    while True:
        stats = client.get("/_sim/stats").json()
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_stats_count_cancelled_stream(client: httpx.Client) -> None:
    before = client.get("/_sim/stats").json()
    stream(client, "text")
    done = wait_for(client, lambda s: s["completed"] > before["completed"])
    assert done["completed"] == before["completed"] + 1 and done["open_streams"] == 0
    body = {"model": "text;chunk=2;delay=0.05", "messages": MESSAGES, "stream": True}
    with connect_sse(client, "POST", "/v1/chat/completions", json=body) as source:
        events = source.iter_sse()  # keep a reference: a collected iterator closes the response
        next(events)
        assert client.get("/_sim/stats").json()["open_streams"] == 1
    after = wait_for(client, lambda s: s["cancelled"] > before["cancelled"])
    assert after["cancelled"] == before["cancelled"] + 1 and after["open_streams"] == 0
    assert after["completed"] == done["completed"]
    assert after["last_cancel_at"] is not None and after["last_cancel_at"] <= time.monotonic()


def test_pure_builders() -> None:
    status, headers, frames = build_frames("unknown-model;chunk=100", {"messages": MESSAGES})
    assert status == 200 and headers == {} and frames[-1] == {"_op": "done"}
    assert assemble_completion(frames, "m")["choices"][0]["message"]["content"] == "You said: ping"
    status, headers, frames = build_frames("rate_limited;retry_after=3", {})
    assert status == 429 and headers == {"Retry-After": "3"} and "error" in frames[0]
    opts = parse_model("parallel_tools;chunk=3;delay=0.01;done=0;bogus=1")
    assert (opts.scenario, opts.chunk, opts.delay, opts.done) == ("parallel_tools", 3, 0.01, False)
    assert parse_model("large").chunk == 256 and parse_model("slow_first_byte").ttfb == 2.0
    with pytest.raises(ValueError):
        parse_model("text;usage=sometimes")


# -- the `agent` scenario (scripts the model's side for the real CLIs) -------------------


def _agent_call(body: dict[str, Any]) -> tuple[str | None, str]:
    """(called tool or None, text) of the agent's answer to ``body``."""
    from gateway.simulator.scenarios import assemble_completion

    _, _, frames = build_frames("agent", body)
    message = assemble_completion(frames, "agent")["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    return (calls[0]["function"]["name"] + " " + calls[0]["function"]["arguments"] if calls else None), message.get("content") or ""


def test_agent_follows_the_plan_across_tool_results_and_compaction() -> None:
    from gateway.protocols.responses.compaction import SUMMARY_PROMPT

    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    user = {"role": "user", "content": 'go CALL run {"n": 1} then CALL run {"n": 2}'}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "run", "arguments": "{}"}}]}
    result = {"role": "tool", "tool_call_id": "a", "content": "ok-1"}
    assert _agent_call({"messages": [user, {"role": "system", "content": "late system item"}], "tools": tools})[0] == 'run {"n": 1}'
    assert _agent_call({"messages": [user, call, result], "tools": tools})[0] == 'run {"n": 2}'
    # the compaction turn reports progress; after it, the plan resumes at step two
    summary = _agent_call({"messages": [user, call, result, {"role": "user", "content": SUMMARY_PROMPT}]})
    assert summary == (None, "Progress: 1 tool call(s) completed.")
    resumed = {"messages": [user, {"role": "user", "content": "Summary: " + summary[1]}], "tools": tools}
    assert _agent_call(resumed)[0] == 'run {"n": 2}'
    done = [user, call, result, call, {"role": "tool", "tool_call_id": "a", "content": "ok-2"}]
    assert _agent_call({"messages": done, "tools": tools}) == (None, "Done. The tool said: ok-2")
    # an undeclared tool is never called
    assert _agent_call({"messages": [user]})[0] is None
