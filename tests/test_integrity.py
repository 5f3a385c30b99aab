"""The stream-integrity matrix: 3 protocols x 2 modes x 13 upstream behaviours, each
driven through the official SDK stream helper (strict) with the exact outcome asserted.

Compatible mode may repair (locally, then by regeneration within the bound); realtime
has already relayed the bytes, so a bad terminal becomes the protocol's error event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.drivers import DRIVERS

BUDGET = 20_000


@dataclass(frozen=True)
class Expect:
    ok: bool
    finish: str | None = None
    tools: tuple[str, ...] = ()
    code: str = ""


VALID_TOOL = Expect(True, "tool_calls", ("get_weather",))

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
}

ROUTES = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


@pytest.fixture(scope="module")
def budget_gateways(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gateway]:
    return {
        mode: start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=mode, max_collect_bytes=BUDGET)
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
    if expect.ok:
        assert outcome.ok, outcome.error
        assert outcome.finish == expect.finish
        assert tuple(name for name, _ in outcome.tools) == expect.tools
        for name, args in outcome.tools:
            assert isinstance(args, dict)
            if name == "get_weather":
                assert args == {"city": "Paris", "unit": "celsius"}
        if expect.finish in ("stop", "length"):
            assert outcome.text
    else:
        assert not outcome.ok, f"expected {expect.code}, got success {outcome}"
        assert expect.code in outcome.error


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
