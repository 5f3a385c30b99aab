"""The stream-integrity matrix: 3 protocols x 2 modes x every scripted upstream behaviour,
each driven through the official SDK stream helper (strict) with the exact outcome
asserted: finish, tool names and arguments, text and reasoning, block order, usage
numbers, call ids, and the wire order the SDKs let pass (Responses sequence numbers
contiguous from 0 after ``response.created``; ``message_start`` first).

Compatible mode may repair (locally, then by regeneration within the bound); realtime
has already relayed the bytes, so a bad terminal becomes the protocol's error event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.simulator.quirks import THINK_ANSWER, THINK_REASONING
from gateway.simulator.reply import TEXT
from gateway.stream.signatures import MARKER
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.drivers import DRIVERS, PROMPT

BUDGET = 20_000
ARGS = {"get_weather": {"city": "Paris", "unit": "celsius"}, "get_time": {"timezone": "Europe/Paris"}}
#: The simulator's usage: characters // 4 + 1 (the prompt is the one user message).
TEXT_USAGE = (len(PROMPT) // 4 + 1, len(TEXT) // 4 + 1)


@dataclass(frozen=True)
class Expect:
    ok: bool
    finish: str | None = None
    tools: tuple[str, ...] = ()
    code: str = ""
    text: str | None = None
    reasoning: str | None = None
    blocks: tuple[str, ...] | None = None  # Messages and Responses (Chat has no block order)
    usage: tuple[int, int] | None = None
    ids: tuple[str, ...] | None = None
    message: str = ""  # also in the error text the client saw


VALID_TOOL = Expect(True, "tool_calls", ("get_weather",))
TWO_TOOLS = Expect(True, "tool_calls", ("get_weather", "get_time"))
TEXT_OK = Expect(True, "stop", text=TEXT, usage=TEXT_USAGE)


def both(expect: Expect) -> tuple[Expect, Expect]:
    return expect, expect

# cell -> (model, tool_choice, expected in compatible, expected in realtime)
CELLS: dict[str, tuple[str, Any, Expect, Expect]] = {
    "valid_tools": ("parallel_tools;chunk=5", None, Expect(True, "tool_calls", ("get_weather", "get_time")),
                    Expect(True, "tool_calls", ("get_weather", "get_time"))),
    "truncated_json_once": ("invalid_json;repairable=1;chunk=4", None, VALID_TOOL, Expect(False, code="tool_call_invalid")),
    "truncated_json_always": ("invalid_json;chunk=4", None, Expect(False, code="tool_call_invalid"),
                              Expect(False, code="tool_call_invalid")),
    "fenced_json": ("fenced_json;chunk=6", None, VALID_TOOL, Expect(False, code="tool_call_invalid")),
    "undeclared_tool": ("undeclared_tool", None, Expect(False, code="tool_call_invalid"), Expect(False, code="tool_call_invalid")),
    "tool_choice_violated": ("tool", "none", Expect(False, code="tool_call_invalid"), Expect(False, code="tool_call_invalid")),
    "identity_change": ("identity_change;chunk=4", None, Expect(False, code="tool_identity_changed"),
                        Expect(False, code="tool_identity_changed")),
    "content_filter": ("content_filter", None, Expect(True, "content_filter"), Expect(True, "content_filter")),
    "length": ("length", None, Expect(True, "length"), Expect(True, "length")),
    "no_finish": ("no_finish", None, Expect(False, code="upstream_incomplete"), Expect(False, code="upstream_incomplete")),
    "drop": ("drop", None, Expect(False, code="upstream_disconnected"), Expect(False, code="upstream_disconnected")),
    "error_frame": ("error_frame", None, Expect(False, code="upstream_error"), Expect(False, code="upstream_error")),
    "budget_exceeded": (f"large;size={BUDGET * 3}", None, Expect(False, code="response_too_large"),
                        Expect(False, code="response_too_large")),
    "slow_first_byte": ("slow_first_byte;ttfb=1.1", None, Expect(True, "stop"), Expect(True, "stop")),
    # -- round 2: what real servers send --------------------------------------------------
    "object_arguments": ("object_arguments", None, *both(TWO_TOOLS)),
    "usage_in_choice": ("usage_in_choice;chunk=16", None, *both(TEXT_OK)),
    "usage_x_groq": ("usage_x_groq;chunk=16", None, *both(TEXT_OK)),
    "usage_running": ("usage_running;chunk=16", None, *both(TEXT_OK)),
    "usage_on_finish_chunk": ("text;chunk=16;usage=last;finish_chunk=last", None, *both(TEXT_OK)),
    "finish_eos": ("finish_eos;chunk=16", None, *both(TEXT_OK)),
    "finish_eos_token": ("finish_eos_token;chunk=16", None, *both(TEXT_OK)),
    "finish_empty": ("finish_empty;chunk=16", None, *both(TEXT_OK)),
    "finish_tool_call": ("finish_tool_call;chunk=5", None, *both(VALID_TOOL)),
    "finish_function_call": ("finish_function_call;chunk=5", None, *both(VALID_TOOL)),
    "finish_error": ("finish_error", None, *both(Expect(False, code="upstream_error", message="finish_reason 'error'"))),
    "legacy_function_call": ("legacy_function_call;chunk=6", None,
                             *both(Expect(True, "tool_calls", ("get_weather", "get_time"), ids=("call_sim_0", "call_sim_1")))),
    "only_function_call": ("only_function_call;chunk=6", None, *both(VALID_TOOL)),
    "explicit_nulls": ("explicit_nulls;chunk=5", None,
                       *both(Expect(True, "tool_calls", ("get_weather",), text="Let me check. ", blocks=("text", "tool")))),
    "json_error_200": ("json_error_200", None,
                       *both(Expect(False, code="upstream_error", message="tool_choice 'required' is not supported"))),
    "html_200": ("html_200", None, *both(Expect(False, code="upstream_error", message="Gateway Timeout from the proxy"))),
    "empty_200": ("empty_200", None, *both(Expect(False, code="upstream_empty_response"))),
    "reasoning_after_text": ("reasoning_after_text;chunk=7", None, *both(Expect(
        True, "stop", text="Here is a first part. And the rest.", reasoning="First I think.Now I think again.",
        blocks=("reasoning", "text", "reasoning", "text")))),
    "reasoning_with_content": ("reasoning_with_content", None, *both(Expect(
        True, "stop", text="Answer done.", reasoning="Thinking. More.", blocks=("reasoning", "text", "reasoning", "text")))),
    "think_tags": ("think_tags;chunk=3", None, *both(Expect(
        True, "stop", text=THINK_ANSWER, reasoning=THINK_REASONING, blocks=("reasoning", "text")))),
    "think_close_only": ("think_close_only;chunk=4", None, *both(Expect(
        True, "stop", text=THINK_ANSWER, reasoning=THINK_REASONING, blocks=("reasoning", "text")))),
    "think_tags_not_opted_in": ("text;chunk=9", None, *both(Expect(True, "stop", text=TEXT, reasoning="", blocks=("text",)))),
    "gemini_signature": ("gemini_signature;chunk=6", None, *both(Expect(
        True, "tool_calls", ("get_weather", "get_time"), ids=("call_sim_0" + MARKER, "call_sim_1")))),
    "interleaved_tools": ("interleaved_tools;chunk=4", None, *both(TWO_TOOLS)),
    "slow_headers": ("slow_headers;ttfb=1.2", None, *both(TEXT_OK)),
}

ROUTES = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


@pytest.fixture(scope="module")
def budget_gateways(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gateway]:
    return {
        mode: start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=mode, max_collect_bytes=BUDGET,
                            reasoning_tags={"think_*": "auto"})
        for mode in ("compatible", "realtime")
    }


def route_exists(gateway: Gateway, protocol: str) -> bool:
    return any(getattr(r, "path", None) == ROUTES[protocol] for r in gateway.app.routes)


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("mode", ["compatible", "realtime"])
@pytest.mark.parametrize("protocol", list(DRIVERS))
def test_matrix(budget_gateways: dict[str, Gateway], protocol: str, mode: str, cell: str) -> None:
    gateway = budget_gateways[mode]
    if not route_exists(gateway, protocol):
        pytest.skip(f"{protocol} room not built yet")
    model, tool_choice, *expected = CELLS[cell]
    expect = expected[0] if mode == "compatible" else expected[1]
    outcome = DRIVERS[protocol](gateway.url, model, tool_choice)
    assert outcome.violations == []
    if expect.ok:
        assert outcome.ok, outcome.error
        assert outcome.finish == expect.finish
        assert tuple(name for name, _ in outcome.tools) == expect.tools
        for name, args in outcome.tools:
            assert args == ARGS[name]
        if expect.finish in ("stop", "length"):
            assert outcome.text
        if expect.text is not None:
            assert outcome.text == expect.text
        if expect.reasoning is not None:
            assert outcome.reasoning == expect.reasoning
        if expect.blocks is not None and protocol != "chat":
            assert tuple(outcome.blocks) == expect.blocks
        if expect.usage is not None:
            assert outcome.usage == expect.usage
        if expect.ids is not None:
            # an id ending in the marker: the sealed signature follows (random per answer)
            assert len(outcome.tool_ids) == len(expect.ids) and all(
                got == want or (want.endswith(MARKER) and got.startswith(want) and len(got) > len(want))
                for got, want in zip(outcome.tool_ids, expect.ids))
    else:
        assert not outcome.ok, f"expected {expect.code}, got success {outcome}"
        assert expect.code in outcome.error
        assert expect.message in outcome.error
        assert "SSEError" not in outcome.error


def audit_rows(gateway: Gateway, model: str) -> list[dict[str, Any]]:
    """The newest audit record for ``model`` once the background writer has stored it."""
    def newest() -> list[dict[str, Any]]:
        return httpx.get(gateway.url + "/admin/api/audit", params={"model": model, "limit": 1}, headers=gateway.admin).json()["data"]

    wait_for(newest)
    return newest()


def test_regeneration_is_bounded_and_recorded(budget_gateways: dict[str, Gateway], simulator: Simulator) -> None:
    """truncated JSON always: the original plus exactly tool_repair_attempts (2) re-asks."""
    simulator.clear()
    outcome = DRIVERS["chat"](budget_gateways["compatible"].url, "invalid_json;chunk=4")
    assert not outcome.ok and "after 2 regeneration" in outcome.error
    sent = [r["body"] for r in simulator.requests() if r["path"].endswith("/chat/completions")]
    assert len(sent) == 3
    assert "repair" not in str(sent[0]["messages"])
    for body in sent[1:]:
        assert body["messages"][:-1] == sent[0]["messages"]
        assert "not a JSON object" in body["messages"][-1]["content"]
    records = audit_rows(budget_gateways["compatible"], "invalid_json;chunk=4")  # what each attempt did
    repairs = records[0]["repairs"]
    assert [(r["kind"], r["attempt"], r["outcome"]) for r in repairs] == [
        ("original", 0, "invalid"), ("regenerate", 1, "invalid"), ("regenerate", 2, "invalid")]
    assert all(r["usage"]["completion_tokens"] > 0 for r in repairs)
    assert records[0]["outcome"] == "error" and records[0]["error_code"] == "tool_call_invalid"


def test_a_repaired_answer_records_its_attempts(budget_gateways: dict[str, Gateway]) -> None:
    gateway = budget_gateways["compatible"]
    outcome = DRIVERS["messages"](gateway.url, "invalid_json;repairable=1;chunk=3")
    assert outcome.ok and outcome.tools == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    records = audit_rows(gateway, "invalid_json;repairable=1;chunk=3")
    assert [(r["kind"], r["outcome"]) for r in records[0]["repairs"]] == [("original", "invalid"), ("regenerate", "valid")]
    assert records[0]["outcome"] == "success" and records[0]["tool_calls"] == 1


def test_compatible_keepalives_continue_during_regeneration(budget_gateways: dict[str, Gateway]) -> None:
    """Each attempt is slow; the client sees keepalive comments throughout, then success."""
    with httpx.stream(
        "POST", budget_gateways["compatible"].url + "/v1/chat/completions", timeout=20,
        json={"model": "invalid_json;repairable=1;first_chunk_delay=0.7", "stream": True,
              "messages": [{"role": "user", "content": "x"}],
              "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    keepalives = [i for i, line in enumerate(lines) if line == ": keepalive"]
    assert len(keepalives) >= 2
    tool_frames = [i for i, line in enumerate(lines) if "tool_calls" in line]
    assert tool_frames and min(tool_frames) > max(keepalives)
    assert lines[-1] == "data: [DONE]"


def test_policy_is_frozen_per_request(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Mode and budget change while a request runs: it finishes under its own policy;
    the next request uses the new one."""
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, stream_mode="compatible")
    arrivals: list[float] = []
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", timeout=20,
        json={"model": "text;chunk=4;delay=0.04", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as response:
        assert response.headers["x-codebuddy2api-stream-mode"] == "compatible"
        gateway.live.update({"stream_mode": "realtime", "max_collect_bytes": 10})
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                arrivals.append(time.monotonic())
    # compatible replays the collected text at once: all content frames arrive together
    assert len(arrivals) == 1
    # the next request: realtime (many frames) and the 10-byte budget applies
    outcome = DRIVERS["chat"](gateway.url, "text;chunk=4")
    assert not outcome.ok and "response_too_large" in outcome.error
    gateway.live.update({"max_collect_bytes": 0})
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", timeout=20,
        json={"model": "text;chunk=4", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as response:
        assert response.headers["x-codebuddy2api-stream-mode"] == "realtime"
        content_frames = [line for line in response.iter_lines() if '"content":"' in line and '"content":""' not in line]
    assert len(content_frames) > 5
