"""SIGTERM drains what the gateway accepted, with real processes (``make test-faults``).

- a Responses WebSocket turn in flight runs to its end; a frame asking for a new turn during
  the drain gets the wrapped 503 ``server_shutting_down``; the socket then closes 1012; an
  idle one closes 1012 at once;
- requests sent just before the signal on connections the gateway had accepted each get
  their answer, never a reset;

and the audit holds exactly one row per request (counted from the SQLite file after exit).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from gateway.simulator.reply import TEXT
from tests.conftest import ServerLoop, wait_for
from tests.processes import GatewayProcess, children, own_simulator

pytestmark = pytest.mark.faults


def audit_rows(data_dir: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(data_dir / "codebuddy2api.sqlite3") as db:
        return db.execute("SELECT request_id, outcome, error_code, protocol, transport FROM audit").fetchall()


def receive_all(ws: Any, until: float = 60.0) -> tuple[list[dict[str, Any]], int | None]:
    """Every event the server sends, then the close code it closed with."""
    events: list[dict[str, Any]] = []
    try:
        while True:
            events.append(json.loads(ws.recv(timeout=until)))
    except ConnectionClosed as closed:
        return events, closed.rcvd.code if closed.rcvd is not None else None


def test_sigterm_lets_a_websocket_turn_finish_refuses_new_turns_then_closes_1012(
    server_loop: ServerLoop, tmp_path: Path
) -> None:
    with own_simulator(server_loop) as sim:
        gateway = GatewayProcess("--data-dir", str(tmp_path / "data"), "--upstream-url", sim.url + "/v1",
                                 "--shutdown-timeout", "30", "--log-level", "warning", log_dir=tmp_path)
        try:
            gateway.wait_healthy()
            url = f"ws://127.0.0.1:{gateway.port}/v1/responses"
            idle = connect(url, open_timeout=30)
            idle.send(json.dumps({"type": "response.create", "model": "text", "input": "hi", "store": False}))
            while json.loads(idle.recv(timeout=30))["type"] != "response.completed":
                pass
            busy = connect(url, open_timeout=30)
            busy.send(json.dumps({"type": "response.create", "model": "text;chunk=4;delay=0.15",
                                  "input": "hi", "store": False}))
            first: list[dict[str, Any]] = []
            while not first or first[-1]["type"] != "response.in_progress":  # the turn is in flight
                first.append(json.loads(busy.recv(timeout=30)))
            gateway.proc.send_signal(signal.SIGTERM)
            idle_events, idle_code = receive_all(idle)
            # the drain has begun (the idle socket is closed): a new turn on the busy socket now
            busy.send(json.dumps({"type": "response.create", "model": "text", "input": "again", "store": False}))
            rest, busy_code = receive_all(busy)
            assert gateway.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
        finally:
            gateway.stop()
    assert idle_events == [] and idle_code == 1012
    events = first + rest
    completed = [e for e in events if e["type"] == "response.completed"]
    assert len(completed) == 1, [e["type"] for e in events]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == TEXT and completed[0]["response"]["status"] == "completed"
    refusal = events[-1]
    assert refusal["type"] == "error" and refusal["status"] == 503, refusal
    assert refusal["error"]["code"] == "server_shutting_down"
    assert events.index(completed[0]) < len(events) - 1  # the refusal comes after the whole answer
    assert busy_code == 1012
    rows = audit_rows(tmp_path / "data")
    assert len(rows) == 3 and len({r[0] for r in rows}) == 3, rows
    assert sorted((r[1], r[2]) for r in rows) == [("refused", "server_shutting_down"), ("success", None), ("success", None)]
    assert {r[4] for r in rows} == {"websocket"}
    assert "Traceback" not in gateway.log()


BODIES = {
    "/v1/chat/completions": {"model": "text", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {"model": "text", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "text", "input": "hi"},
}


def raw_request(port: int, path: str, stream: bool, model: str = "text") -> bytes:
    body = json.dumps({**BODIES[path], "stream": stream, "model": model}).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def read_answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (b"" prefix on a reset: no answer)."""
    sock.settimeout(60)
    got = bytearray()
    try:
        while piece := sock.recv(65536):
            got += piece
    except ConnectionResetError:
        pass
    return bytes(got)


def test_requests_sent_just_before_sigterm_are_each_answered_and_audited_once(
    server_loop: ServerLoop, tmp_path: Path
) -> None:
    """60 requests (3 protocols, JSON and streams) on connections the gateway had accepted
    (half kept alive after a first request, half opened just now), sent 30 ms before SIGTERM,
    a quarter of them still arriving (the request line before the signal, the rest 0.3 s
    after): each gets its whole answer (a 200, or a named 503 in the protocol's shape), none
    a reset or a bare close, and the audit holds exactly one row for each."""
    with own_simulator(server_loop) as sim:
        gateway = GatewayProcess("--data-dir", str(tmp_path / "data"), "--upstream-url", sim.url + "/v1",
                                 "--shutdown-timeout", "30", "--log-level", "warning", log_dir=tmp_path)
        try:
            gateway.wait_healthy()
            kept = []
            for _ in range(30):  # accepted and idle: each has had one answer
                sock = socket.create_connection(("127.0.0.1", gateway.port))
                sock.sendall(f"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1:{gateway.port}\r\n\r\n".encode())
                got = b""
                while not got.endswith(b"}"):  # the whole answer (a small JSON body)
                    got += sock.recv(65536)
                assert got.startswith(b"HTTP/1.1 200")
                kept.append(sock)
            fresh = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(30)]
            time.sleep(0.5)  # the fresh ones are accepted by now (the loop is idle)
            paths = list(BODIES)
            socks = kept + fresh
            requests = [raw_request(gateway.port, paths[i % 3], stream=i % 2 == 0) for i in range(len(socks))]
            split = {i: requests[i].index(b"\r\n") + 2 for i in range(len(socks)) if i % 4 == 3}
            for i, sock in enumerate(socks):  # a quarter still on its way: its request line only
                sock.sendall(requests[i][: split.get(i, len(requests[i]))])
            time.sleep(0.03)
            gateway.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            for i, at in split.items():  # the rest of the request that was on its way
                socks[i].sendall(requests[i][at:])
            answers = read_all(socks)
            assert gateway.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
        finally:
            gateway.stop()
    request_ids = []
    for i, answer in enumerate(answers):
        assert answer.startswith(b"HTTP/1.1 "), (i, answer[:200])
        head, _, body = answer.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        request_ids.append(headers[b"x-request-id"].decode())
        if status == 503:
            assert b"server_shutting_down" in body, (i, body[:300])
        else:
            assert status == 200, (i, head)
            complete = (b"[DONE]", b"message_stop", b"response.completed") if i % 2 == 0 else (b'"finish_reason":"stop"', b'"stop_reason":"end_turn"', b'"status":"completed"')
            assert complete[i % 3] in body, (i, body[-300:])
    rows = audit_rows(tmp_path / "data")
    assert sorted(r[0] for r in rows) == sorted(request_ids)
    assert "Traceback" not in gateway.log()


def test_a_request_begun_before_sigterm_gets_the_header_timeout_an_idle_connection_one_second(
    server_loop: ServerLoop, tmp_path: Path
) -> None:
    """At the signal: a connection that has sent its request line only (a slow or busy client)
    is answered when the rest comes 2 s later, past the 1 s an idle connection is still read
    (before, it was closed bare at 1 s); one that never finishes its headers is closed by the
    header timeout (4 s here) from its first bytes; an idle one closes after its 1 s."""
    with own_simulator(server_loop) as sim:
        gateway = GatewayProcess("--data-dir", str(tmp_path / "data"), "--upstream-url", sim.url + "/v1",
                                 "--shutdown-timeout", "30", "--header-timeout", "4", "--log-level", "warning",
                                 log_dir=tmp_path)
        try:
            gateway.wait_healthy()
            slow, stuck, idle = (socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(3))
            request = raw_request(gateway.port, "/v1/chat/completions", stream=True)
            line = request.index(b"\r\n") + 2
            slow.sendall(request[:line])
            stuck.sendall(request[:line])
            time.sleep(0.3)  # each has its first bytes read
            gateway.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            idle_answer = read_answer(idle)
            idle_closed = time.monotonic() - signalled
            time.sleep(max(0.0, 2.0 - idle_closed))
            slow.sendall(request[line:])
            slow_answer, stuck_answer = read_all([slow, stuck])
            stuck_closed = time.monotonic() - signalled
            assert gateway.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
        finally:
            gateway.stop()
    assert idle_answer == b"" and idle_closed < 3.5
    assert stuck_answer == b"" and 3.5 <= stuck_closed + 0.3, stuck_closed  # the header timeout, not the 1 s
    assert request_ids_of([slow_answer], [True], ["/v1/chat/completions"]) == [
        r[0] for r in audit_rows(tmp_path / "data")]
    assert b"[DONE]" in slow_answer


def request_ids_of(answers: list[bytes], streams: list[bool], paths: list[str]) -> list[str]:
    """Each answer is a whole one (a 200 with the protocol's complete ending) or the named
    503 ``server_shutting_down``, never a reset or a bare close; their request ids."""
    complete = {
        ("/v1/chat/completions", True): b"[DONE]", ("/v1/chat/completions", False): b'"finish_reason":"stop"',
        ("/v1/messages", True): b"message_stop", ("/v1/messages", False): b'"stop_reason":"end_turn"',
        ("/v1/responses", True): b"response.completed", ("/v1/responses", False): b'"status":"completed"',
    }
    unanswered = [i for i, answer in enumerate(answers) if not answer.startswith(b"HTTP/1.1 ")]
    assert unanswered == [], f"{len(unanswered)} of {len(answers)} reset or closed without an answer"
    ids = []
    for i, answer in enumerate(answers):
        head, _, body = answer.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        ids.append(headers[b"x-request-id"].decode())
        if status == 503:
            assert b"server_shutting_down" in body and headers[b"retry-after"] == b"1", (i, head, body[:300])
        else:
            assert status == 200, (i, head)
            assert complete[paths[i], streams[i]] in body, (i, body[-300:])
    return ids


def read_all(socks: list[socket.socket]) -> list[bytes]:
    answers: list[bytes] = [b""] * len(socks)

    def read(i: int) -> None:
        answers[i] = read_answer(socks[i])

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(socks))]
    for t in readers:
        t.start()
    for t in readers:
        t.join(90)
    return answers


def test_requests_in_the_listen_backlog_at_sigterm_are_each_answered_and_audited_once(
    server_loop: ServerLoop, tmp_path: Path
) -> None:
    """60 connections the kernel completed while the gateway's loop was not accepting (the
    process stopped, as a loop busy for 300 ms would be), each with a whole request sent
    (3 protocols, JSON and streams), then SIGTERM: each gets its answer or the named 503,
    none a reset (on the old code every one was reset: the listening socket closed with
    them queued), and the audit holds exactly one row for each."""
    with own_simulator(server_loop) as sim:
        gateway = GatewayProcess("--data-dir", str(tmp_path / "data"), "--upstream-url", sim.url + "/v1",
                                 "--shutdown-timeout", "30", "--log-level", "warning", log_dir=tmp_path)
        try:
            gateway.wait_healthy()
            paths = [list(BODIES)[i % 3] for i in range(60)]
            streams = [i % 2 == 0 for i in range(60)]
            gateway.proc.send_signal(signal.SIGSTOP)  # nothing accepted from here: the backlog fills
            try:
                socks = [socket.create_connection(("127.0.0.1", gateway.port), timeout=30) for _ in paths]
                for sock, path, stream in zip(socks, paths, streams, strict=True):
                    sock.sendall(raw_request(gateway.port, path, stream))
                gateway.proc.send_signal(signal.SIGTERM)  # pending until the process runs again
                time.sleep(0.3)  # past uvicorn's 0.1 s tick: it closes its listener first thing
            finally:
                gateway.proc.send_signal(signal.SIGCONT)
            answers = read_all(socks)
            assert gateway.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
        finally:
            gateway.stop()
    request_ids = request_ids_of(answers, streams, paths)
    rows = audit_rows(tmp_path / "data")
    assert sorted(r[0] for r in rows) == sorted(request_ids)
    assert "Traceback" not in gateway.log()


def test_with_workers_the_backlog_at_sigterm_is_answered_and_a_later_client_refused(
    server_loop: ServerLoop, tmp_path: Path
) -> None:
    """``--workers 2``, both stopped while 30 connections queue with their requests, then
    SIGTERM to every process (systemd's control-group stop; the parent signals the workers
    again): each queued request gets its answer or the named 503, and a client connecting
    while a stream still drains is refused, never queued. On the old code the parent kept
    its copy of the listening socket open until the workers had exited: the queued requests
    and the late client sat there unserved, then were reset. The audit holds exactly one
    row per answered request. (30 and the slow stream: under one worker's share of
    ``--max-concurrent``, since one worker may take them all.)"""
    with own_simulator(server_loop) as sim:
        gateway = GatewayProcess("--data-dir", str(tmp_path / "data"), "--upstream-url", sim.url + "/v1",
                                 "--workers", "2", "--shutdown-timeout", "30", "--log-level", "info",
                                 log_dir=tmp_path)
        try:
            gateway.wait_healthy(60)
            wait_for(lambda: gateway.log().count("Application startup complete") == 2, timeout=60)
            workers = children(gateway.proc.pid)
            assert len(workers) == 2
            slow = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)  # drains ~8 s
            slow.sendall(raw_request(gateway.port, "/v1/chat/completions", True, "text;chunk=4;delay=0.3"))
            slow_head = slow.recv(65536)
            assert slow_head.startswith(b"HTTP/1.1 200")  # in flight
            paths = [list(BODIES)[i % 3] for i in range(30)]
            streams = [i % 2 == 0 for i in range(30)]
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)  # nothing accepted from here: the backlog fills
            try:
                socks = [socket.create_connection(("127.0.0.1", gateway.port), timeout=30) for _ in paths]
                for sock, path, stream in zip(socks, paths, streams, strict=True):
                    sock.sendall(raw_request(gateway.port, path, stream))
                for pid in (gateway.proc.pid, *workers):
                    os.kill(pid, signal.SIGTERM)  # pending in the workers until they run again
                time.sleep(0.3)  # well under the parent's 5 s health check of a stopped worker
            finally:
                for pid in workers:
                    os.kill(pid, signal.SIGCONT)
            wait_for(lambda: "Received SIGTERM, exiting." in gateway.log(), timeout=30)  # the parent stops
            time.sleep(0.3)  # its terminate_all follows that line at once
            assert gateway.proc.poll() is None  # the slow stream still drains
            late: bytes | None = None
            try:
                with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as client:
                    client.sendall(raw_request(gateway.port, "/v1/chat/completions", False))
                    late = read_answer(client)
            except ConnectionRefusedError:
                pass
            answers = read_all([*socks, slow])
            assert gateway.proc.wait(60) in (0, -signal.SIGTERM)
        finally:
            gateway.stop()
    head, _, slow_body = (slow_head + answers.pop()).partition(b"\r\n\r\n")
    assert b"data: [DONE]" in slow_body, slow_body[-300:]  # the whole stream
    slow_id = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])[b"x-request-id"].decode()
    request_ids = request_ids_of(answers, streams, paths)
    assert late is None, late[:200]  # refused, not taken into a queue no process serves
    rows = audit_rows(tmp_path / "data")
    assert sorted(r[0] for r in rows) == sorted([*request_ids, slow_id])
    assert "Traceback" not in gateway.log()


def test_with_workers_stopped_before_the_parent_a_request_meanwhile_is_answered(
    server_loop: ServerLoop, tmp_path: Path
) -> None:
    """``--workers 2``, SIGTERM to the workers first, the parent 0.3 s later (systemd signals
    every process of the unit, the parent reads its signals every 0.5 s). 30 requests sent in
    between, on new connections, are each answered (or the named 503) and audited once: a
    worker keeps accepting until the parent stops new handshakes. On the old code the workers
    had closed their copies of the listening socket and the parent's queued the requests, to
    reset them at its close."""
    with own_simulator(server_loop) as sim:
        gateway = GatewayProcess("--data-dir", str(tmp_path / "data"), "--upstream-url", sim.url + "/v1",
                                 "--workers", "2", "--shutdown-timeout", "30", "--log-level", "info",
                                 log_dir=tmp_path)
        try:
            gateway.wait_healthy(60)
            wait_for(lambda: gateway.log().count("Application startup complete") == 2, timeout=60)
            workers = children(gateway.proc.pid)
            assert len(workers) == 2
            paths = [list(BODIES)[i % 3] for i in range(30)]
            streams = [i % 2 == 0 for i in range(30)]
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
            time.sleep(0.3)  # past the workers' 0.1 s tick: their shutdown has begun
            socks = [socket.create_connection(("127.0.0.1", gateway.port), timeout=30) for _ in paths]
            for sock, path, stream in zip(socks, paths, streams, strict=True):
                sock.sendall(raw_request(gateway.port, path, stream))
            gateway.proc.send_signal(signal.SIGTERM)
            answers = read_all(socks)
            assert gateway.proc.wait(60) in (0, -signal.SIGTERM)
        finally:
            gateway.stop()
    request_ids = request_ids_of(answers, streams, paths)
    rows = audit_rows(tmp_path / "data")
    assert sorted(r[0] for r in rows) == sorted(request_ids)
    assert "Traceback" not in gateway.log()
