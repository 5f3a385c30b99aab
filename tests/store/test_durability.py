"""Nothing lost under faults, with real processes: the gateway as a subprocess, its data
dir on a small tmpfs that fills up, the simulator as the upstream.

- disk full: every audit row and stored response of the requests served meanwhile is in
  the store after space comes back (spilled, then replayed), ``/readyz`` 503 meanwhile;
- a read-only data dir at start-up: one line on stderr, exit code 2;
- a healthy store under concurrent load (in-process gateway): every row written directly, none spilled.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from gateway.simulator.reply import TEXT
from tests.conftest import ServerLoop, Simulator, wait_for
from tests.processes import GatewayProcess, own_simulator

# real processes and induced faults: `make test-faults` (CI runs it), not the default suite
pytestmark = pytest.mark.faults


ADMIN_TOKEN = "durability-admin-token-0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *options: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (skips when mounting is not permitted)."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem has no space left."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size) == size:
                    pass
    finally:
        os.close(fd)
    return filler


def audit_ids(gateway: GatewayProcess) -> list[str]:
    export = httpx.get(gateway.url + "/admin/api/audit/export", timeout=30, headers=ADMIN)
    assert export.status_code == 200
    return [orjson.loads(line)["request_id"] for line in export.content.splitlines() if line]


def test_disk_full_then_space_back_loses_no_audit_row_and_no_stored_response(
    simulator: Simulator, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "data", "6m") as data:
        gateway = GatewayProcess(
            "--data-dir", str(data), "--upstream-url", simulator.url + "/v1", "--audit-bodies",
            "--spill-max-bytes", str(2 * 1024 * 1024), "--log-level", "warning", "--admin-token", ADMIN_TOKEN,
            log_dir=tmp_path,
        )
        try:
            gateway.wait_healthy()
            assert httpx.get(gateway.url + "/readyz").json() == {"status": "ready"}
            client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True,
                                   max_retries=0)
            filler = fill(data)
            stored: dict[str, str] = {}  # response id -> its text

            def one(i: int) -> str:
                if i % 5 == 0:  # 60 stored responses
                    response = client.responses.with_raw_response.create(model="echo", input=f"turn {i}", store=True)
                    parsed = response.parse()
                    stored[parsed.id] = parsed.output_text
                elif i % 2:
                    with client.chat.completions.with_streaming_response.create(
                        model="echo", messages=[{"role": "user", "content": f"s {i}"}], stream=True
                    ) as response:
                        text = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)
                    assert text == f"You said: s {i}"
                else:
                    response = client.chat.completions.with_raw_response.create(
                        model="echo", messages=[{"role": "user", "content": f"j {i}"}])
                    assert response.parse().choices[0].message.content == f"You said: j {i}"
                return response.headers["x-request-id"]

            with ThreadPoolExecutor(8) as threads:
                sent = list(threads.map(one, range(300)))
            assert len(set(sent)) == 300 and len(stored) == 60
            # degraded, not red: this replica still answers (its records wait in the journal)
            ready = wait_for(lambda: httpx.get(gateway.url + "/readyz").json()["status"] == "degraded") is not None
            readyz = httpx.get(gateway.url + "/readyz")
            body = readyz.json()
            codes = {r["code"] for r in body["reasons"]}
            assert ready and readyz.status_code == 200 and {"store_unwritable", "spill_in_use"} <= codes, body
            assert {r["impact"] for r in body["reasons"]} == {"degraded"}, body
            store = httpx.get(gateway.url + "/admin/api/status", headers=ADMIN).json()["store"]
            assert store["store_writable"] is False and store["spill_entries"] > 0 and store["lost"] == 0
            # meanwhile, stored responses are served from the spill (previous_response_id works too)
            some = next(iter(stored))
            assert client.responses.retrieve(some).output_text == stored[some]
            follow = client.responses.create(model="echo", input="and then?", previous_response_id=some, store=False)
            assert follow.output_text == "You said: and then?"
            filler.unlink()  # space is back
            wait_for(lambda: httpx.get(gateway.url + "/readyz").json() == {"status": "ready"}, timeout=30)
            wait_for(lambda: len(set(audit_ids(gateway)) & set(sent)) == len(sent), timeout=30)
            ids = audit_ids(gateway)
            assert len(ids) == len(set(ids))  # exactly one row per request
            for response_id, text in stored.items():
                assert client.responses.retrieve(response_id).output_text == text
            metrics = httpx.get(gateway.url + "/metrics").text
            assert 'codebuddy2api_records_lost_total{kind="audit"} 0.0' in metrics
            assert 'codebuddy2api_records_lost_total{kind="response"} 0.0' in metrics
            spilled = [line for line in metrics.splitlines() if line.startswith('codebuddy2api_records_spilled_total{kind="audit"}')]
            assert spilled and float(spilled[0].split()[-1]) > 0, "the store never failed: the test proved nothing"
            assert "store_write_failed" in gateway.log() and "Traceback" not in gateway.log()
        finally:
            gateway.stop()


def test_a_read_only_data_dir_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    target = tmp_path / "ro"
    if os.geteuid() == 0:
        context = tmpfs(target, "1m", "ro")
    else:
        target.mkdir()
        target.chmod(0o500)
        context = contextlib.nullcontext(target)
    with context:
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--port", "0", "--data-dir", str(target / "data")],
            capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")},
        )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(target / "data") in lines[0] and "--data-dir" in lines[0]


# -- a PostgreSQL pause does not stall open streams --------------------------------------------


def postgres_processes(url: str) -> list[int]:
    """The PostgreSQL server's processes: the postmaster (the parent of our backend) and
    every child of it. The server runs on this machine (loopback)."""
    import psycopg

    def parent(pid: int) -> int:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])

    with psycopg.connect(url) as conn:  # our backend exits with the connection: read it while open
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        postmaster = parent(backend)
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if parent(int(entry.name)) == postmaster:
                    children.append(int(entry.name))
    return [postmaster, *children]


def test_a_postgresql_pause_does_not_stall_open_streams(
    server_loop: ServerLoop, postgres_schema: str, tmp_path: Path
) -> None:
    """SIGSTOP every PostgreSQL process for a few seconds while streams flow, and meanwhile
    make the pool learn something (two credentials 429: cooldowns to persist). Streams
    already flowing keep flowing, new requests are served, and after SIGCONT every audit
    row is in the store."""
    import signal
    import threading
    import time

    from gateway.app import create_app
    from gateway.settings import Settings
    from gateway.simulator.server import create_simulator_app
    from tests.conftest import Gateway

    sim = Simulator(server_loop.serve(create_simulator_app()))
    settings = Settings(upstream_url=[sim.url + "/v1"], upstream_api_key="sk-a,sk-b", data_dir=tmp_path,
                        database_url=postgres_schema, stream_mode="realtime", keepalive_interval=0.5,
                        spill_max_bytes=1 << 20)
    app = create_app(settings, {n: "default" for n in Settings.model_fields})  # type: ignore[arg-type]
    gateway = Gateway(server_loop.serve(app), app)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    pause = 3.0
    arrivals: list[list[float]] = [[] for _ in range(4)]
    texts: list[str] = ["" for _ in range(4)]

    def stream(i: int) -> None:
        with client.chat.completions.stream(model="text;chunk=1;delay=0.06", timeout=60,
                                            messages=[{"role": "user", "content": f"s{i}"}]) as s:
            for event in s:
                if event.type == "content.delta":
                    arrivals[i].append(time.monotonic())
            texts[i] = s.get_final_completion().choices[0].message.content or ""

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: all(len(a) >= 5 for a in arrivals), timeout=15)
    pids = postgres_processes(postgres_schema)
    served_during: list[tuple[str, float]] = []
    stopped_at = time.monotonic()
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # a short-lived worker may be gone
                os.kill(pid, signal.SIGSTOP)
        # a state change to persist (both credentials cool down), then a request served from memory
        limited = httpx.post(gateway.base_url + "/chat/completions", timeout=pause,
                             json={"model": "rate_limited;retry_after=30", "messages": [{"role": "user", "content": "x"}]})
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "upstream_rate_limited"
        served_during.append((limited.headers["x-request-id"], time.monotonic()))
        answer = client.chat.completions.with_raw_response.create(
            model="echo", messages=[{"role": "user", "content": "during"}], timeout=pause)
        assert answer.parse().choices[0].message.content == "You said: during"
        served_during.append((answer.headers["x-request-id"], time.monotonic()))
        time.sleep(max(0.0, pause - (time.monotonic() - stopped_at)))
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    for t in threads:
        t.join(60)
    assert all(at < resumed_at for _, at in served_during)  # served while PostgreSQL was stopped
    assert all(text == TEXT for text in texts)
    for times in arrivals:
        during = [b - a for a, b in zip(times, times[1:]) if stopped_at <= b <= resumed_at]
        assert during, "no chunk arrived while PostgreSQL was stopped"
        assert max(during) < pause / 3, f"a stream stalled for {max(during):.2f} s of a {pause} s pause"
    # the cooldowns reached the store once it was back, and so did every audit row
    wait_for(lambda: len(app.state.credential_state.load()) == 2 and all(
        s["cooldowns"] for s in app.state.credential_state.load().values()), timeout=30)
    for rid, _ in served_during:
        wait_for(lambda: httpx.get(gateway.url + f"/admin/api/audit/{rid}", headers=gateway.admin).status_code == 200,
                 timeout=30)


# -- graceful shutdown with a deadline -------------------------------------------------------


def test_sigterm_with_streams_on_a_stalled_upstream_ends_each_with_an_error_event_and_one_record(
    server_loop: ServerLoop, tmp_path: Path
) -> None:
    """10 streams (3 protocols) and 2 JSON requests wait on an upstream that stalls before
    its headers or mid-answer; SIGTERM: the gateway exits within the deadline plus a few
    seconds, every stream got the protocol's error event and every JSON request a 503
    (server_shutting_down), every upstream stream was closed, and the audit holds exactly
    one row per request."""
    import signal
    import sqlite3
    import threading
    import time

    from tests.drivers import DRIVERS

    with own_simulator(server_loop) as sim:
        timeout = 3.0
        gateway = GatewayProcess("--data-dir", str(tmp_path / "data"), "--upstream-url", sim.url + "/v1",
                                 "--shutdown-timeout", str(timeout), "--keepalive-interval", "0.3",
                                 "--log-level", "warning", log_dir=tmp_path)
        outcomes: dict[int, object] = {}
        try:
            gateway.wait_healthy()
            protocols = list(DRIVERS)
            models = ["slow_first_byte;ttfb=600", "text;chunk=4;delay=600"]

            def run(i: int) -> None:
                if i < 10:
                    outcomes[i] = DRIVERS[protocols[i % 3]](gateway.url, models[i % 2])
                    return
                outcomes[i] = httpx.post(gateway.base_url + "/chat/completions", timeout=30, json={
                    "model": models[i % 2], "messages": [{"role": "user", "content": "json"}]})

            threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(12)]
            for t in threads:
                t.start()
            # a bound that catches a gateway that never forwards them, not a busy machine (a loaded run took over 15 s)
            wait_for(lambda: len([r for r in sim.requests() if r["path"].endswith("/chat/completions")]) == 12, timeout=60)
            wait_for(lambda: sim.stats()["open_streams"] == 6, timeout=60)  # the mid-answer half is streaming
            time.sleep(1.0)  # every client has had a keepalive: all ten streams are committed (200)
            signalled = time.monotonic()
            gateway.proc.send_signal(signal.SIGTERM)
            gateway.proc.wait(timeout + 10)
            took = time.monotonic() - signalled
            for t in threads:
                t.join(10)
        finally:
            gateway.stop()
        wait_for(lambda: sim.stats()["open_streams"] == 0, timeout=5)  # every upstream stream closed
    assert timeout <= took < timeout + 6, f"exit took {took:.1f} s"
    assert len(outcomes) == 12
    for i in range(10):
        outcome = outcomes[i]
        assert not outcome.ok and "server_shutting_down" in outcome.error, (i, outcome)  # type: ignore[attr-defined]
    for i in (10, 11):
        answer = outcomes[i]
        assert isinstance(answer, httpx.Response) and answer.status_code == 503
        assert answer.json()["error"]["code"] == "server_shutting_down" and answer.headers["retry-after"] == "1"
    with sqlite3.connect(tmp_path / "data" / "codebuddy2api.sqlite3") as db:
        rows = db.execute("SELECT request_id, outcome, error_code, protocol, streamed FROM audit").fetchall()
    assert len(rows) == 12 and len({r[0] for r in rows}) == 12
    assert {(r[1], r[2]) for r in rows} == {("error", "server_shutting_down")}
    assert sorted((r[3], r[4]) for r in rows) == sorted([(protocols[i % 3], 1) for i in range(10)] + [("chat", 0)] * 2)
    assert "Traceback" not in gateway.log()


def test_a_healthy_store_under_concurrent_load_takes_every_row_itself(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """400 stored Responses, 32 at a time: response saves and audit batches run in worker
    threads together on one SQLite connection. Every row lands in the store directly, none
    by way of the spill journal (a cursor leaving the connection's lock once made most of
    them fail over to it under load), and every response is there to continue from."""
    import asyncio

    from tests.conftest import start_gateway

    gw = start_gateway(server_loop, simulator, tmp_path_factory)

    async def fire() -> list[httpx.Response]:
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=60) as client:
            async def one(i: int) -> httpx.Response:
                async with gate:
                    return await client.post("/responses", json={"model": "text", "input": f"turn {i}", "store": True})
            return await asyncio.gather(*(one(i) for i in range(400)))

    answers = asyncio.run(fire())
    assert [a.status_code for a in answers] == [200] * 400
    assert all(a.json()["output"][0]["content"][0]["text"] == TEXT for a in answers)
    durable = gw.app.state.observability.durable
    db = gw.app.state.db
    wait_for(lambda: db.execute("SELECT count(*) FROM audit")[0][0] == 400, timeout=20)
    assert (durable.spilled, durable.lost, durable.store_writable) == (0, 0, True), durable.status()
    stored = {row[0] for row in db.execute("SELECT id FROM responses")}
    assert stored == {a.json()["id"] for a in answers}


# -- a killed gateway's parse workers do not outlive it ----------------------------------------


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sigkilled_gateways_parse_workers_exit_with_it(tmp_path: Path) -> None:
    """A dense body is parsed in a forkserver worker process. SIGKILL the gateway (an OOM
    kill): the forkserver and its worker exit within a few seconds (they lived on, idle,
    ~60-90 MiB each, before: each holds a write end of the pipes that would tell it)."""
    import signal

    proc = GatewayProcess("--simulator", "--data-dir", str(tmp_path / "data"), "--log-level", "warning",
                          log_dir=tmp_path)
    try:
        proc.wait_healthy()
        dense = {"model": "text", "max_tokens": 8,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 30_000}
        answer = httpx.post(proc.base_url + "/chat/completions", json=dense, timeout=60)
        assert answer.status_code == 200, answer.text
        workers = _descendants(proc.proc.pid)
        assert workers, "the dense body was parsed in no worker process"
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if _running(pid)]
    finally:
        proc.stop()
