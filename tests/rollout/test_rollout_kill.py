"""SIGKILL between a rollout call's commit and its terminal (issue #40): the record was
durable before the client could have the answer (commit before release), but the client
never got it; its retry then extends the same call the lost one extended. The read-back
must not call that rollout complete: the lost call is ``undelivered``, the rollout
``forked``, and the trajectory without undelivered calls is one straight segment.

The window is made wide and real: a client that reads the opening frames and then stops
reading, with a terminal far larger than the socket buffers (the Responses object echoes
the request's ``metadata``, which never goes upstream, so the call's tokens stay small).
The terminal is then never wholly handed over; the gateway is killed after the record is
in the store. docs/capture.md, "Delivery".
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.store.db import SQLITE_FILENAME
from tests.conftest import Simulator, wait_for
from tests.processes import GatewayProcess
from tests.rollout.test_rollouts import CALLS, RESPONSES_TOOLS, next_input

pytestmark = pytest.mark.faults

CLIENT_KEY = "rollout-kill-client-key-0123456789"
ADMIN_TOKEN = "rollout-kill-admin-token-0123456789"
MODEL = "agent;chunk=7"
#: Characters of the lost call's metadata: more than the kernel's socket buffers hold.
METADATA_CHARS = 7_000_000


def gateway(data: Path, simulator: Simulator, tmp_path: Path) -> GatewayProcess:
    return GatewayProcess(
        "--data-dir", str(data), "--upstream-url", simulator.url + "/v1", "--api-key", CLIENT_KEY,
        "--admin-token", ADMIN_TOKEN, "--capture-tokens", "vllm", "--log-level", "warning", log_dir=tmp_path,
    )


def client(gw: GatewayProcess, rollout: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=30,
                         _strict_response_validation=True)


def read_back(gw: GatewayProcess, rollout: str, part: str = "", **params: str) -> dict[str, Any]:
    response = httpx.get(f"{gw.url}/admin/api/rollouts/{rollout}{part}", params=params,
                         headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def turn(gw: GatewayProcess, rollout: str, items: list[dict[str, Any]], store: bool = False) -> list[dict[str, Any]]:
    """One streamed Responses turn through the SDK's stream helper: its output items."""
    with client(gw, rollout).responses.stream(model=MODEL, input=items, tools=RESPONSES_TOOLS, store=store) as s:  # type: ignore[arg-type]
        response = s.get_final_response()
    return [o.model_dump(exclude_none=True) for o in response.output]


def stored(data: Path, table: str, rollout: str) -> int:
    """Rows of ``rollout`` in ``table`` (rollout_calls, rollout_marks) in the SQLite file."""
    with contextlib.closing(sqlite3.connect(data / SQLITE_FILENAME, timeout=5)) as conn:
        return int(conn.execute(f"SELECT COUNT(*) FROM {table} WHERE rollout_id = ?", (rollout,)).fetchone()[0])


def stalled_reader(gw: GatewayProcess, rollout: str, items: list[dict[str, Any]]) -> tuple[socket.socket, bytearray]:
    """A streamed Responses call whose client reads the opening frames, then nothing: its
    socket, open (the caller closes it), and what it read. The 7 MB ``metadata`` makes every frame that
    carries the Response object larger than what the kernel's buffers take."""
    body = json.dumps({"model": MODEL, "input": items, "tools": RESPONSES_TOOLS, "store": False, "stream": True,
                       "metadata": {"padding": "m" * METADATA_CHARS}}).encode()
    head = (f"POST /rollouts/{rollout}/v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\n"
            f"Authorization: Bearer {CLIENT_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", gw.port))
    sock.sendall(head + body)
    seen, scanned, at = bytearray(), 0, -1
    while True:  # up to the end of response.in_progress (the opening frames)
        chunk = sock.recv(1 << 20)
        assert chunk, bytes(seen[:300])
        seen += chunk
        if at < 0:
            at = seen.find(b"event: response.in_progress", max(0, scanned - 64))
            scanned = at if at >= 0 else len(seen)
        if at >= 0 and seen.find(b"\n\n", max(at, scanned - 2)) >= 0:
            break
        scanned = len(seen)
    assert seen.startswith(b"HTTP/1.1 200"), bytes(seen[:300])
    return sock, seen


def read_to_the_end(sock: socket.socket, seen: bytearray) -> bytes:
    """Everything the client could still read once the gateway is gone."""
    sock.settimeout(10)
    with contextlib.suppress(ConnectionError):
        while chunk := sock.recv(1 << 20):
            seen += chunk
    return bytes(seen)


def test_a_call_killed_after_its_commit_is_undelivered_and_its_retry_forks_the_rollout(
    simulator: Simulator, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    rollout, nonce = f"kill.{secrets.token_hex(4)}:r-1", secrets.token_hex(6)
    gw = gateway(data, simulator, tmp_path)
    restarted = None
    try:
        gw.wait_healthy()
        items: list[dict[str, Any]] = [{"role": "user", "content": f"{nonce}: {CALLS}"}]
        first = turn(gw, rollout, items)  # call A: delivered, its mark stored
        assert [o["name"] for o in first if o["type"] == "function_call"] == ["get_weather"]
        next_input(items, first)
        assert read_back(gw, rollout)["calls"][0]["delivered"] is True  # known at once in this process
        wait_for(lambda: stored(data, "rollout_marks", rollout) == 1, timeout=10)  # and in the store
        lost, read = stalled_reader(gw, rollout, items)  # call X: its client stops reading before the terminal
        try:
            wait_for(lambda: stored(data, "rollout_calls", rollout) == 2, timeout=30)  # X's record: committed before release
            time.sleep(1.0)  # the terminal handed to a transport that cannot take it all
            gw.proc.send_signal(signal.SIGKILL)
            gw.proc.wait(10)
            got = read_to_the_end(lost, read)
        finally:
            lost.close()
        terminal = got.find(b"event: response.completed")  # the client never had X's whole terminal event
        assert terminal < 0 or got.find(b"\n\n", terminal) < 0, got[-200:]

        restarted = gateway(data, simulator, tmp_path)
        restarted.wait_healthy()
        lost = read_back(restarted, rollout)
        assert lost["complete"] is False and lost["forked"] is False
        [x] = [c for c in lost["calls"] if c["seq"] == 1]
        assert x["outcome"] == "success" and x["delivered"] is False and lost["undelivered"] == [x["call_id"]]
        assert any(x["call_id"] in reason and "not known to have reached the client" in reason for reason in lost["incomplete"])

        retried = turn(restarted, rollout, items)  # call Y: the client retries the turn it never got
        next_input(items, retried)
        last = turn(restarted, rollout, items)  # call Z: the next turn, after Y
        assert "Done. The tool said: get_time" in json.dumps(last)

        snap = read_back(restarted, rollout)
        a, x_again, y, z = snap["calls"]
        assert x_again["call_id"] == x["call_id"] and x_again["delivered"] is False
        assert [c["delivered"] for c in (a, y, z)] == [True, True, True]
        assert snap["complete"] is False and snap["undelivered"] == [x["call_id"]]
        assert snap["forked"] is True and snap["forks"] == [{"call_id": y["call_id"], "extends": a["call_id"]}]
        assert x["continuity"]["previous_call_id"] == y["continuity"]["previous_call_id"] == a["call_id"]
        forked = read_back(restarted, rollout, "/trajectory")["segments"]
        assert [s["call_ids"] for s in forked] == [[a["call_id"], x["call_id"]], [a["call_id"], y["call_id"], z["call_id"]]]
        straight = read_back(restarted, rollout, "/trajectory", undelivered="exclude")["segments"]
        assert [s["call_ids"] for s in straight] == [[a["call_id"], y["call_id"], z["call_id"]]]
        export = httpx.get(f"{restarted.url}/admin/api/rollouts/export",
                           params={"shape": "trl", "undelivered": "exclude", "since": str(a["started_at"] - 1)},
                           headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
        assert export.status_code == 200, export.text
        [line] = [json.loads(raw) for raw in export.text.splitlines() if json.loads(raw).get("rollout_id") == rollout]
        assert line["call_ids"] == [a["call_id"], y["call_id"], z["call_id"]] and line["complete"] is False
        assert "Traceback" not in gw.log() + restarted.log()
    finally:
        gw.stop()
        if restarted is not None:
            restarted.stop()
