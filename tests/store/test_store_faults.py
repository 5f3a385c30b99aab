"""Store, disk and worker faults against the running gateway (a real subprocess, real
SQLite, the simulator as the upstream): a write-locked store (a second connection holding
``BEGIN EXCLUSIVE``), an unreadable one (its WAL read marks locked by another process),
SIGKILL during the outage, ``--workers`` replacements, a 1 MB data dir, PostgreSQL
unreachable at start-up. docs/operations.md, "Store, disk and worker faults"."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from gateway.store.db import SQLITE_FILENAME
from tests.conftest import Simulator, wait_for
from tests.processes import GatewayProcess, children, free_port, paced_probe
from tests.store.test_durability import tmpfs

# real processes and induced faults: `make test-faults` (CI runs it), not the default suite
pytestmark = pytest.mark.faults

CLIENT_KEY = "store-faults-client-key-0123456789"
ADMIN_TOKEN = "store-faults-admin-token-0123456789"


def gateway(data: Path, simulator: Simulator, tmp_path: Path, *extra: str) -> GatewayProcess:
    return GatewayProcess(
        "--data-dir", str(data), "--upstream-url", simulator.url + "/v1", "--api-key", CLIENT_KEY,
        "--admin-token", ADMIN_TOKEN, "--log-level", "warning", *extra, log_dir=tmp_path,
    )


def openai_client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=CLIENT_KEY, max_retries=0, timeout=30,
                         _strict_response_validation=True)


def anthropic_client(gw: GatewayProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=CLIENT_KEY, max_retries=0, timeout=30,
                               _strict_response_validation=True)


def streamed_response(client: openai.OpenAI, text: str, **extra: object) -> tuple[str, str, float]:
    """One streamed Responses turn through the SDK's stream helper: (id, text, seconds to the end)."""
    started = time.monotonic()
    with client.responses.stream(model="echo", input=text, store=True, **extra) as stream:  # type: ignore[arg-type]
        final = stream.get_final_response()
    return final.id, final.output_text, time.monotonic() - started


def chat_stream(client: openai.OpenAI, text: str) -> str:
    with client.chat.completions.stream(model="echo", messages=[{"role": "user", "content": text}]) as stream:
        return stream.get_final_completion().choices[0].message.content or ""


def messages_stream(client: anthropic.Anthropic, text: str) -> str:
    with client.messages.stream(model="echo", max_tokens=64, messages=[{"role": "user", "content": text}]) as stream:
        message = stream.get_final_message()
    return "".join(b.text for b in message.content if b.type == "text")


def rows(data: Path, table: str = "audit") -> int:
    with contextlib.closing(sqlite3.connect(data / SQLITE_FILENAME, timeout=30)) as conn:
        return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


@contextlib.contextmanager
def write_locked(data: Path) -> Iterator[None]:
    """Another connection holds the SQLite file's write lock (``BEGIN EXCLUSIVE``)."""
    conn = sqlite3.connect(data / SQLITE_FILENAME, isolation_level=None, timeout=30)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


@contextlib.contextmanager
def unreadable(data: Path) -> Iterator[None]:
    """Another process holds every WAL read mark (and the write lock) in the file's shared
    memory: a reader retries ~10 s, then fails with "locking protocol"."""
    fd = os.open(str(data / SQLITE_FILENAME) + "-shm", os.O_RDWR)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 120)  # WAL_WRITE_LOCK
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 5, 123)  # WAL_READ_LOCK(0..4)
                break
            except OSError:
                fcntl.lockf(fd, fcntl.LOCK_UN, 8, 120)
                assert time.monotonic() < deadline, "could not take the read marks"
                time.sleep(0.01)
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, 8, 120)
        os.close(fd)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * 99 // 100) - 1)]


def test_a_write_locked_store_holds_no_answer_and_a_sigkill_loses_no_finished_record(
    simulator: Simulator, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    gw = gateway(data, simulator, tmp_path)
    restarted = None
    try:
        gw.wait_healthy()
        client, claude = openai_client(gw), anthropic_client(gw)
        normal = [streamed_response(client, f"warm {i}")[2] for i in range(12)]
        wait_for(lambda: rows(data) == 12, timeout=10)
        with write_locked(data):
            locked: list[float] = []
            journaled: list[tuple[str, str]] = []
            for i in range(24):
                response_id, text, seconds = streamed_response(client, f"locked {i}")
                assert text == f"You said: locked {i}"
                locked.append(seconds)
                journaled.append((response_id, text))
            assert chat_stream(client, "chat while locked") == "You said: chat while locked"
            assert messages_stream(claude, "messages while locked") == "You said: messages while locked"
            # previous_response_id to a response only the journal has: found
            follow_id, follow, _ = streamed_response(client, "and then?", previous_response_id=journaled[-1][0])
            assert follow == "You said: and then?"
            history = client.responses.retrieve(journaled[3][0])
            assert history.output_text == journaled[3][1]
            with pytest.raises(openai.BadRequestError) as unknown:
                client.responses.create(model="echo", input="x", previous_response_id="resp_" + "0" * 24)
            assert unknown.value.code == "previous_response_not_found"
            sent = 12 + 24 + 2 + 1 + 1  # warm, locked, chat, messages, follow-up, unknown id
            readyz = httpx.get(gw.url + "/readyz")  # degraded, still in rotation: it answers all of the above
            ready = readyz.json()
            assert readyz.status_code == 200 and ready["status"] == "degraded", ready
            assert {r["code"] for r in ready["reasons"]} >= {"store_unwritable", "spill_in_use"}, ready
            time.sleep(1.0)  # every request above finished >= 1 s ago
            gw.proc.send_signal(signal.SIGKILL)
            gw.proc.wait(10)
        assert p99(locked) <= p99(normal) + 1.0, (p99(normal), p99(locked))
        restarted = gateway(data, simulator, tmp_path)
        restarted.wait_healthy()
        wait_for(lambda: rows(data) == sent, timeout=30)  # replayed: one row per request, none lost
        assert rows(data, "responses") == 12 + 24 + 1
        again = openai_client(restarted)
        assert again.responses.retrieve(follow_id).output_text == "You said: and then?"
        assert "Traceback" not in gw.log() + restarted.log()
    finally:
        gw.stop()
        if restarted is not None:
            restarted.stop()


def test_an_unreadable_store_costs_only_what_needs_it(simulator: Simulator, tmp_path: Path) -> None:
    data = tmp_path / "data"
    gw = gateway(data, simulator, tmp_path)
    try:
        gw.wait_healthy()
        client, claude = openai_client(gw), anthropic_client(gw)
        stored_id, _, _ = streamed_response(client, "remember me")
        wait_for(lambda: rows(data, "responses") == 1, timeout=10)
        with unreadable(data):
            for i in range(3):  # each answers normally, none waits out the store's ~10 s
                started = time.monotonic()
                assert chat_stream(client, f"chat {i}") == f"You said: chat {i}"
                answer = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": f"j {i}"}])
                assert answer.choices[0].message.content == f"You said: j {i}"
                assert messages_stream(claude, f"msg {i}") == f"You said: msg {i}"
                assert time.monotonic() - started < 5.0
            refused = httpx.post(gw.base_url + "/responses", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                                 json={"model": "echo", "input": "next", "previous_response_id": stored_id}, timeout=30)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "store_unavailable" and error["type"] and set(error) == {"message", "type", "param", "code"}
            with pytest.raises(openai.APIStatusError) as retrieve:
                client.responses.retrieve(stored_id)
            assert retrieve.value.status_code == 503 and retrieve.value.body["code"] == "store_unavailable"  # type: ignore[index]
        # readable again: the same lookup works, and every request has its row
        wait_for(lambda: httpx.post(gw.base_url + "/responses", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                                    json={"model": "echo", "input": "next", "previous_response_id": stored_id},
                                    timeout=30).status_code == 200, timeout=30)
        wait_for(lambda: rows(data) >= 1 + 9 + 1 + 1, timeout=30)
        assert "Traceback" not in gw.log()
    finally:
        gw.stop()


def test_a_worker_replaced_after_a_locked_start_and_its_gauges_go(simulator: Simulator, tmp_path: Path) -> None:
    data = tmp_path / "data"
    gw = gateway(data, simulator, tmp_path, "--workers", "2", "--worker-restart-attempts", "20",
                 "--log-level", "info")
    try:
        gw.wait_healthy(60)
        wait_for(lambda: gw.log().count("Application startup complete") == 2, timeout=60)  # both serve
        first = children(gw.proc.pid)
        assert len(first) == 2
        metrics_dir = data / "prometheus-multiproc"

        def gauged() -> set[int]:  # workers with live gauge files (written once a request ran there)
            return {pid for pid in first if any(p.name.startswith("gauge_") and p.name.endswith(f"_{pid}.db")
                                                for p in metrics_dir.iterdir())}

        warm = openai_client(gw)
        wait_for(lambda: chat_stream(warm, "warm") == "You said: warm" and bool(gauged()), timeout=30)
        victim = min(gauged())
        with write_locked(data):
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: "failed to start" in gw.log(), timeout=60)  # its replacement's start-up write
            assert gw.proc.poll() is None  # the gateway goes on
        wait_for(lambda: gw.log().count("Application startup complete") == 3, timeout=90)  # the replacement
        now = children(gw.proc.pid)
        assert len(now) == 2 and victim not in now and len(now & first) == 1
        assert not [p.name for p in metrics_dir.iterdir() if p.name.startswith("gauge_") and p.name.endswith(f"_{victim}.db")]
        client = openai_client(gw)
        wait_for(lambda: httpx.get(gw.url + "/readyz").status_code == 200, timeout=30)
        for i in range(6):
            assert chat_stream(client, f"after {i}") == f"You said: after {i}"
        in_flight = [line for line in httpx.get(gw.url + "/metrics").text.splitlines()
                     if line.startswith("codebuddy2api_in_flight_requests{")]
        assert in_flight and all(float(line.split()[-1]) == 0 for line in in_flight), in_flight
        gw.proc.terminate()
        assert gw.proc.wait(60) == 0
    finally:
        gw.stop()


def test_the_gateway_exits_1_when_a_replacement_keeps_failing(simulator: Simulator, tmp_path: Path) -> None:
    data, spill = tmp_path / "data", tmp_path / "spill"
    gw = gateway(data, simulator, tmp_path, "--workers", "2", "--worker-restart-attempts", "1", "--spill-dir", str(spill))
    try:
        gw.wait_healthy(60)
        wait_for(lambda: len(children(gw.proc.pid)) == 2, timeout=60)
        subprocess.run(["rm", "-rf", str(spill)], check=True)
        spill.write_text("not a directory")  # every new worker now fails to open its journal
        os.kill(min(children(gw.proc.pid)), signal.SIGKILL)
        assert gw.proc.wait(90) == 1
        errors = [line for line in gw.log().splitlines() if line.startswith("codebuddy2api: error:")]
        assert len(errors) == 1 and "giving up" in errors[0] and "--worker-restart-attempts 1" in errors[0], errors
    finally:
        gw.stop()


def test_a_1mb_data_dir_turns_readiness_red_and_refuses_every_request(simulator: Simulator, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "data", "1m") as data:
        gw = gateway(data, simulator, tmp_path)
        try:
            gw.wait_healthy()
            assert "spill journal NOT reserved" in gw.log()  # named in the banner
            ready = httpx.get(gw.url + "/readyz")
            assert ready.status_code == 503 and "spill_not_reserved" in {r["code"] for r in ready.json()["reasons"]}
            client, claude = openai_client(gw), anthropic_client(gw)
            marker = "unrecordable-" + data.name + str(gw.port)
            for call in (lambda: chat_stream(client, marker), lambda: streamed_response(client, marker),
                         lambda: client.chat.completions.create(model="echo", messages=[{"role": "user", "content": marker}])):
                with pytest.raises(openai.APIStatusError) as refused:
                    call()
                assert refused.value.status_code == 503 and refused.value.body["code"] == "recording_unavailable"  # type: ignore[index]
            with pytest.raises(anthropic.APIStatusError) as refused_messages:
                messages_stream(claude, marker)
            body = refused_messages.value.body
            assert refused_messages.value.status_code == 503 and body["error"]["type"] == "overloaded_error"  # type: ignore[index]
            assert "cannot record" in body["error"]["message"]  # type: ignore[index]
            assert marker not in str(simulator.requests())  # nothing went upstream
            metrics = httpx.get(gw.url + "/metrics").text
            assert 'codebuddy2api_unrecordable_requests_total{action="refused"} 4.0' in metrics
            assert "codebuddy2api_spill_reserved 0.0" in metrics
        finally:
            gw.stop()


def test_serve_unrecorded_chooses_availability(simulator: Simulator, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "data", "1m") as data:
        gw = gateway(data, simulator, tmp_path, "--serve-unrecorded")
        try:
            gw.wait_healthy()
            assert "SERVED UNRECORDED" in gw.log()
            assert chat_stream(openai_client(gw), "anyway") == "You said: anyway"
            readyz = httpx.get(gw.url + "/readyz")  # it serves: degraded, not out of rotation
            assert readyz.status_code == 200 and readyz.json()["status"] == "degraded"
            assert {r["code"]: r["impact"] for r in readyz.json()["reasons"]}["spill_not_reserved"] == "degraded"
            metrics = httpx.get(gw.url + "/metrics").text
            assert 'codebuddy2api_unrecordable_requests_total{action="served"} 1.0' in metrics
        finally:
            gw.stop()


def test_postgresql_unreachable_at_start_waits_then_exits_75_in_one_line(tmp_path: Path) -> None:
    port = free_port()  # a loopback port nobody listens on (no bind(0) will be handed it meanwhile)
    url = f"postgresql://gw:pg-password-not-shown@127.0.0.1:{port}/gateway"
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--data-dir", str(tmp_path / "d"), "--database-url", url,
         "--database-wait", "4", "--port", "0"],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")},
    )
    assert result.returncode == 75, result.stderr  # EX_TEMPFAIL: the systemd unit restarts it (not 2)
    lines = result.stderr.strip().splitlines()
    waiting = [line for line in lines if line.startswith("codebuddy2api: waiting for database")]
    assert len(waiting) >= 2 and "(attempt 1, next in 1 s)" in waiting[0] and f"127.0.0.1:{port}/gateway" in waiting[0]
    assert lines[-1].startswith("codebuddy2api: error: database 127.0.0.1:") and "unreachable after 4 s" in lines[-1]
    assert "Traceback" not in result.stderr and "pg-password-not-shown" not in result.stderr


def test_a_stopped_postgresql_holds_no_responses_answer_and_lookups_are_503(
    server_loop: object, postgres_schema: str, tmp_path: Path
) -> None:
    """SIGSTOP every PostgreSQL process: Responses ``store: true`` still end within 1 s of
    normal, a response only the journal has is found by ``previous_response_id``, one only
    the store has is 503 ``store_unavailable`` (not a 500, not a wait); after SIGCONT every
    row is in the store."""
    from gateway.app import create_app
    from gateway.settings import Settings
    from gateway.simulator.server import create_simulator_app
    from tests.conftest import Gateway
    from tests.conftest import Simulator as Sim
    from tests.store.test_durability import postgres_processes

    sim = Sim(server_loop.serve(create_simulator_app()))  # type: ignore[attr-defined]
    settings = Settings(upstream_url=[sim.url + "/v1"], data_dir=tmp_path, database_url=postgres_schema,
                        api_key=[CLIENT_KEY], spill_max_bytes=1 << 20)
    app = create_app(settings, {n: "default" for n in Settings.model_fields})  # type: ignore[arg-type]
    gw = Gateway(server_loop.serve(app), app)  # type: ignore[attr-defined]
    client = openai.OpenAI(base_url=gw.base_url, api_key=CLIENT_KEY, max_retries=0, timeout=30,
                           _strict_response_validation=True)
    normal = [streamed_response(client, f"normal {i}")[2] for i in range(6)]
    stored_id = streamed_response(client, "in the store")[0]
    pids = postgres_processes(postgres_schema)
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        with paced_probe(int(gw.url.rsplit(":", 1)[1])) as probes:
            during = [streamed_response(client, f"stopped {i}") for i in range(6)]
        assert [text for _, text, _ in during] == [f"You said: stopped {i}" for i in range(6)]
        # a stalled store write is spilled after 0.5 s (STORE_WRITE_TIMEOUT); 1 s of room for
        # it, stretched by the machine's pace (2.0-2.5 s were measured beside a whole suite
        # and busy loops; a write held until the store answers never ends here)
        assert p99([s for _, _, s in during]) <= p99(normal) + 1.0 * probes.pace, (
            normal, [s for _, _, s in during], probes.pace)
        follow = streamed_response(client, "and then?", previous_response_id=during[-1][0])
        assert follow[1] == "You said: and then?"
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as unavailable:
            client.responses.create(model="echo", input="next", previous_response_id=stored_id)
        assert unavailable.value.status_code == 503 and unavailable.value.body["code"] == "store_unavailable"  # type: ignore[index]
        assert time.monotonic() - started < 5.0
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    wait_for(lambda: app.state.observability.durable.spill_entries == 0, timeout=60)
    for response_id, text, _ in during:
        assert client.responses.retrieve(response_id).output_text == text
    assert client.responses.create(model="echo", input="next", previous_response_id=stored_id).output_text == "You said: next"
