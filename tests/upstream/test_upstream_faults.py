"""Upstream faults (issue #31): connections closed on every path, every wait bounded.

Against the running app and a scripted loopback upstream (tests/scripted_upstream.py):
the gateway's own open fds after hundreds of mid-stream upstream errors (the gateway as a
subprocess, its ``/proc/<pid>/fd`` counted), the idle / total / empty-event bounds through
the three SDKs in both modes, streamed and not, a pool that is full, and readiness.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for
from tests.drivers import DRIVERS, UNARY_DRIVERS, Ask
from tests.processes import GatewayProcess
from tests.scripted_upstream import ScriptedUpstream

# real processes and induced faults: `make test-faults` (CI runs it), not the default suite
pytestmark = pytest.mark.faults

CLIENT_KEY = "upfaults-client-key-0123456789abcdef"
ADMIN_TOKEN = "upfaults-admin-token-0123456789abcdef"
PROTOCOLS = ("chat", "responses", "messages")


@pytest.fixture(scope="module")
def scripted(server_loop: ServerLoop) -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream()
    server_loop.run(upstream.start())
    yield upstream
    server_loop.run(upstream.stop())


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def audit_total(url: str, headers: dict[str, str], **filters: str) -> int:
    response = httpx.get(url + "/admin/api/audit", params={"limit": 1, **filters}, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["total"])


# -- the fd leak -------------------------------------------------------------------------

def _one_error(client: openai.OpenAI, stream: bool) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    if stream:  # committed: the error arrives as the stream's error event
        with pytest.raises(openai.APIError, match="upstream exploded"):
            with client.chat.completions.stream(model="error", messages=messages) as events:
                for _ in events:
                    pass
        return
    with pytest.raises(openai.APIStatusError, match="upstream exploded") as caught:
        client.chat.completions.create(model="error", messages=messages)
    assert caught.value.status_code == 502 and caught.value.body["code"] == "upstream_error"  # type: ignore[index]


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_mid_stream_upstream_errors_and_disconnects_leave_no_open_fd(
    mode: str, scripted: ScriptedUpstream, tmp_path: Path
) -> None:
    gateway = GatewayProcess(
        "--data-dir", str(tmp_path / "data"), "--upstream-url", scripted.url + "/v1", "--stream-mode", mode,
        "--api-key", CLIENT_KEY, "--admin-token", ADMIN_TOKEN, "--log-level", "warning", log_dir=tmp_path,
    )
    try:
        gateway.wait_healthy()
        client = openai.OpenAI(base_url=gateway.base_url, api_key=CLIENT_KEY, max_retries=0,
                               _strict_response_validation=True)
        for stream in (True, False):  # warm: the upstream connection, the tokenizer, the store
            _one_error(client, stream)
        baseline = open_fds(gateway.proc.pid)
        for stream in (True, False):
            for _ in range(200):
                _one_error(client, stream)
        headers = {"authorization": f"Bearer {CLIENT_KEY}"}
        with httpx.Client(timeout=30, headers=headers) as raw:
            for _ in range(50):  # clients that leave mid-stream, the upstream still sending
                with raw.stream("POST", gateway.base_url + "/chat/completions", json={
                        "model": "slow", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as response:
                    assert response.status_code == 200
                    next(response.iter_bytes())
        # idle keep-alive connections may linger for their expiry; none may stay checked out
        wait_for(lambda: open_fds(gateway.proc.pid) <= baseline + 5, timeout=15)
        assert abs(open_fds(gateway.proc.pid) - baseline) <= 5
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        wait_for(lambda: audit_total(gateway.url, admin, error_code="upstream_error") >= 402, timeout=30)
        assert audit_total(gateway.url, admin, error_code="upstream_error") == 402  # one record each
        wait_for(lambda: audit_total(gateway.url, admin, model="slow") >= 50, timeout=30)
        assert audit_total(gateway.url, admin, model="slow", outcome="cancelled") == 50
        assert httpx.get(gateway.url + "/readyz").json() == {"status": "ready"}
    finally:
        gateway.stop()


# -- idle, total and empty-event bounds --------------------------------------------------

IDLE, TOTAL, MAX_EMPTY = 1.0, 2.5, 50

#: scripted model prefix -> (audit error code, what the client's error says, the bound it ends by)
FAULTS = {
    "drip": ("upstream_idle_timeout", "sent nothing for 1 s", IDLE),
    "slow": ("upstream_attempt_timeout", "took longer than 2.5 s", TOTAL),
    "empty": ("upstream_empty_events", "events in a row that carry nothing", IDLE),
}


@pytest.fixture(scope="module")
def bounded(server_loop: ServerLoop, simulator: Simulator, scripted: ScriptedUpstream,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gateway]:
    return {mode: start_gateway(server_loop, simulator, tmp_path_factory, upstream_url=[scripted.url + "/v1"],
                                stream_mode=mode, idle_timeout=IDLE, attempt_timeout=TOTAL,
                                max_empty_events=MAX_EMPTY, keepalive_interval=0.3)
            for mode in ("compatible", "realtime")}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("mode", ["compatible", "realtime"])
def test_an_upstream_that_never_ends_is_cut_at_its_bound_with_one_record(
    mode: str, protocol: str, streamed: bool, fault: str, bounded: dict[str, Gateway]
) -> None:
    gateway = bounded[mode]
    code, said, bound = FAULTS[fault]
    model = f"{fault}-{uuid.uuid4().hex[:8]}"
    drive = (DRIVERS if streamed else UNARY_DRIVERS)[protocol]
    began = time.monotonic()
    outcome = drive(gateway.url, model, ask=Ask(tools=False, timeout=30))
    took = time.monotonic() - began
    assert not outcome.ok and said in outcome.error, outcome
    if not streamed:  # nothing was committed: the route's own 504 body
        assert "504" in outcome.error and ("upstream_" in outcome.error or protocol == "messages")
    assert took < bound + 3.0  # its bound, plus the machine's slack; never the client's 30 s
    rows = wait_for(lambda: audit_total(gateway.url, gateway.admin, model=model) >= 1, timeout=10)
    assert rows >= 0 and audit_total(gateway.url, gateway.admin, model=model) == 1
    assert audit_total(gateway.url, gateway.admin, model=model, error_code=code) == 1


def test_a_messages_stream_cut_for_idleness_ends_in_the_protocol_error_event(bounded: dict[str, Gateway]) -> None:
    client = anthropic.Anthropic(base_url=bounded["realtime"].url, api_key=CLIENT_KEY, max_retries=0,
                                 _strict_response_validation=True)
    events: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model="drip-messages", max_tokens=64,
                                    messages=[{"role": "user", "content": "hi"}]) as stream:
            for event in stream:
                events.append(event.type)
    assert events[:1] == ["message_start"]  # committed: the error came in-stream, after the opening
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "sent nothing for 1 s" in body["error"]["message"]


# -- a full upstream pool ----------------------------------------------------------------

def test_a_full_upstream_pool_answers_a_retryable_503_and_turns_readiness_red(
    server_loop: ServerLoop, simulator: Simulator, scripted: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, upstream_url=[scripted.url + "/v1"],
                            upstream_max_connections=2, upstream_pool_timeout=0.5, idle_timeout=30.0)
    holders: list[httpx.Response] = []
    clients = [httpx.Client(timeout=30) for _ in range(2)]

    def hold(client: httpx.Client) -> None:
        request = client.build_request("POST", gateway.base_url + "/chat/completions", json={
            "model": "hold", "stream": True, "messages": [{"role": "user", "content": "hold on"}]})
        holders.append(client.send(request, stream=True))

    threads = [threading.Thread(target=hold, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: scripted.holding >= 2, timeout=10)
        ready = httpx.get(gateway.url + "/readyz")
        assert ready.status_code == 503
        assert "upstream_pool_exhausted" in [r["code"] for r in ready.json()["reasons"]]
        model = f"pool-{uuid.uuid4().hex[:8]}"
        began = time.monotonic()
        refused = httpx.post(gateway.base_url + "/chat/completions", timeout=30, json={
            "model": model, "messages": [{"role": "user", "content": "anyone free?"}]})
        assert time.monotonic() - began < 0.5 + 3.0  # the pool wait's bound, not the 120 s first-byte one
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "upstream_pool_exhausted" and error["type"] and "retry" in error["message"]
        wait_for(lambda: audit_total(gateway.url, gateway.admin, model=model) >= 1)
        assert audit_total(gateway.url, gateway.admin, model=model, error_code="upstream_pool_exhausted") == 1
        metrics = httpx.get(gateway.url + "/metrics").text
        assert "codebuddy2api_upstream_connections_in_use 2.0" in metrics or scripted.holding < 2
    finally:
        for thread in threads:
            thread.join(10)
        for response in holders:
            response.close()
        for client in clients:
            client.close()
    wait_for(lambda: scripted.holding == 0, timeout=10)
    # free again: the next request is answered, and readiness clears after the hold
    answered = httpx.post(gateway.base_url + "/chat/completions", timeout=30, json={
        "model": "text", "messages": [{"role": "user", "content": "now?"}]})
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] == "Hello there."
    wait_for(lambda: httpx.get(gateway.url + "/readyz").status_code == 200, timeout=10)


# -- a lagging event loop -----------------------------------------------------------------

def test_a_blocked_event_loop_turns_readiness_red_and_shows_in_the_lag_gauge(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, ready_max_loop_lag=0.3)
    wait_for(lambda: httpx.get(gateway.url + "/readyz").status_code == 200, timeout=10)
    server_loop.loop.call_soon_threadsafe(time.sleep, 0.8)  # something blocking on the loop
    time.sleep(0.9)
    ready = httpx.get(gateway.url + "/readyz", timeout=10)
    assert ready.status_code == 503
    (reason,) = [r for r in ready.json()["reasons"] if r["code"] == "event_loop_lag"]
    assert "bound 0.3 s" in reason["message"]
    lag = [line for line in httpx.get(gateway.url + "/metrics").text.splitlines()
           if line.startswith("codebuddy2api_event_loop_lag_seconds ")]
    tasks = [line for line in httpx.get(gateway.url + "/metrics").text.splitlines()
             if line.startswith("codebuddy2api_asyncio_tasks ")]
    assert len(lag) == 1 and float(lag[0].split()[1]) >= 0.0
    assert gateway.app.state.loop_lag.worst >= 0.5
    assert len(tasks) == 1 and float(tasks[0].split()[1]) >= 1
