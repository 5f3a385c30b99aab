"""Session-wide servers on free loopback ports: one simulator, one gateway per mode.

They run on one background event loop in a thread, so tests can use the official
synchronous SDK clients against real HTTP. Started once per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.http.connections import ConnectionLimits, protocol_class
from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
from gateway.live_settings import LiveSettings
from gateway.settings import Settings
from gateway.simulator.server import create_simulator_app

# The tests' own plain httpx calls (``httpx.post(...)`` with no timeout: several hundred)
# wait up to 60 s, not httpx's 5 s: on a loaded 2-core machine a gateway's answer can take
# longer than 5 s, and these bounds are there to catch a hang, not a slow machine. The
# gateway's own clients all name their timeouts, so this changes nothing of the product.
for _phase in ("connect", "read", "write", "pool"):
    setattr(httpx._config.DEFAULT_TIMEOUT_CONFIG, _phase, 60.0)


def wait_for(condition: Callable[[], object], timeout: float = 5.0) -> float:
    """Poll ``condition()`` until it holds; seconds it took (the test fails after ``timeout``)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - start


#: Simulator scenarios with tool calls, every upstream quirk the assembly must survive.
TOOL_SCENARIOS = [
    "tool", "text_then_tool", "parallel_tools", "interleaved_tools", "missing_index", "repeated_id", "late_name",
]


class ServerLoop:
    """A background asyncio loop that hosts embedded uvicorn servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="servers", daemon=True)
        self.thread.start()
        self._servers: list[Any] = []

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: Any, **config: Any) -> str:
        """Serve ``app`` on a fresh loopback port (``config``: more uvicorn options), with
        the connection handling ``serve`` runs (gateway/http/connections.py: a lingering close
        after an answer sent before the body was read, else the client can get a reset for
        its 401; no per-address cap here, the tests all come from 127.0.0.1)."""
        config.setdefault("http", protocol_class(ConnectionLimits(max_per_ip=1 << 20)))
        sock = bind_loopback()
        self._servers.append(self.run(start_embedded(app, sock, **config)))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        """Stop every server at once, each bounded: one by one, a full run's few hundred
        gateways took a minute of the suite (connections left open wait on their idle
        timeouts)."""

        async def stop_all() -> None:
            for server, _ in self._servers:
                server.config.timeout_graceful_shutdown = 5.0
            await asyncio.gather(*(stop_embedded(*s) for s in reversed(self._servers)), return_exceptions=True)

        try:
            self.run(stop_all(), timeout=60)
        except TimeoutError:  # the loop's thread is a daemon: the run ends anyway
            print("warning: the embedded servers did not stop within 60 s", file=sys.stderr)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Gateway:
    url: str
    app: Any

    @property
    def live(self) -> LiveSettings:
        return self.app.state.live

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def admin(self) -> dict[str, str]:
        """Headers that authenticate to the admin API: the app's admin token (configured,
        or generated at start-up: loopback alone is no credential)."""
        return {"authorization": f"Bearer {self.app.state.admin_access.token}"}

    def reset_cooldowns(self) -> None:
        """Forget what earlier tests' 429s taught this (session) gateway's pool: a credential
        still cooling down answers the time left, rounded up, without asking the upstream."""
        listed = httpx.get(self.url + "/admin/api/credentials", headers=self.admin).json()["credentials"]
        for credential in listed:
            reset = httpx.post(f"{self.url}/admin/api/credentials/{credential['id']}/reset", json={}, headers=self.admin)
            assert reset.status_code == 200 and reset.json()["cooldowns"] == {}


#: Seconds a test's own call to the simulator's control routes may take: the simulator shares
#: its event loop with the session's gateways, which on a busy machine (a fault suite and busy
#: loops beside) kept a 5 s default waiting while a 16 MiB answer streamed. A bound, not a speed.
SIM_CONTROL_TIMEOUT = 60.0


@dataclass
class Simulator:
    url: str

    def requests(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/_sim/requests", timeout=SIM_CONTROL_TIMEOUT).json()["requests"]

    def clear(self) -> None:
        httpx.delete(self.url + "/_sim/requests", timeout=SIM_CONTROL_TIMEOUT)

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/_sim/stats", timeout=SIM_CONTROL_TIMEOUT).json()

    def script(self, frames: list[Any], **extra: Any) -> str:
        """Register frames; returns the model name that replays them."""
        response = httpx.post(self.url + "/_sim/scripts", json={"frames": frames, **extra}, timeout=SIM_CONTROL_TIMEOUT)
        response.raise_for_status()
        return "script:" + response.json()["id"]


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def simulator(server_loop: ServerLoop) -> Simulator:
    return Simulator(server_loop.serve(create_simulator_app()))


def start_gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory, **overrides: Any) -> Gateway:
    settings = Settings(
        upstream_url=overrides.pop("upstream_url", [simulator.url + "/v1"]),
        data_dir=tmp_path_factory.mktemp("data"),
        keepalive_interval=overrides.pop("keepalive_interval", 0.5),
        spill_max_bytes=overrides.pop("spill_max_bytes", 1 << 20),  # reserved on disk per gateway
        **overrides,
    )
    sources = {name: "default" for name in Settings.model_fields}
    app = create_app(settings, sources)  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


@pytest.fixture(scope="session")
def gateways(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gateway]:
    """One gateway per stream mode, both in front of the session simulator, keeping alive
    at the product's default interval (5 s): an upstream error status is never overtaken
    by a keepalive that commits the stream first, however busy the machine."""
    return {
        mode: start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=mode, keepalive_interval=5.0)
        for mode in ("compatible", "realtime")
    }


@pytest.fixture(scope="session")
def keepalive_gateways(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gateway]:
    """The same two keeping alive every 0.5 s: for the tests of the keepalives themselves."""
    return {
        mode: start_gateway(server_loop, simulator, tmp_path_factory, stream_mode=mode, keepalive_interval=0.5)
        for mode in ("compatible", "realtime")
    }


@pytest.fixture(params=["compatible", "realtime"])
def gateway(request: pytest.FixtureRequest, gateways: dict[str, Gateway]) -> Gateway:
    return gateways[request.param]


@pytest.fixture(scope="session", autouse=True)
def _quiet_logs() -> None:
    from gateway.observability.logging import configure_logging

    configure_logging("warning")


# -- PostgreSQL (the store's second backend; .ci/postgres.sh starts a server) ------------------

TEST_DATABASE_URL_ENV = "CODEBUDDY2API_TEST_DATABASE_URL"


def with_search_path(url: str, schema: str) -> str:
    """``url`` with libpq ``options`` setting the search_path: one schema per test."""
    return url + ("&" if "?" in url else "?") + f"options=-csearch_path%3D{schema}"


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The test server's URL. Without one the PostgreSQL tests skip, except under CI
    (``CI`` set), where a missing or unreachable server fails them loudly."""
    import os

    import psycopg

    url = os.environ.get(TEST_DATABASE_URL_ENV)
    if not url:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {TEST_DATABASE_URL_ENV} is not: .ci/run must start PostgreSQL", pytrace=False)
        pytest.skip(f"{TEST_DATABASE_URL_ENV} is not set (`source .ci/postgres.sh` starts a server)")
    try:
        psycopg.connect(url, connect_timeout=10).close()
    except psycopg.Error as exc:
        pytest.fail(f"{TEST_DATABASE_URL_ENV} names no reachable server: {type(exc).__name__}: {exc}", pytrace=False)
    return url


@contextlib.contextmanager
def fresh_schema(postgres_url: str) -> Iterator[str]:
    """A URL whose search_path is a fresh, empty schema, dropped when the block ends."""
    import secrets

    import psycopg

    name = "t_" + secrets.token_hex(6)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    try:
        yield with_search_path(postgres_url, name)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {name} CASCADE")


@pytest.fixture
def postgres_schema(postgres_url: str) -> Iterator[str]:
    """A URL whose search_path is a fresh, empty schema (dropped afterwards)."""
    with fresh_schema(postgres_url) as url:
        yield url


@contextlib.contextmanager
def replica_pair(
    server_loop: ServerLoop, postgres_url: str, tmp_path_factory: pytest.TempPathFactory, names: tuple[str, str],
    **settings: Any,
) -> Iterator[tuple[Gateway, Gateway, Simulator]]:
    """Two gateways sharing one fresh PostgreSQL schema as replicas ``names``, in front of a
    simulator of their own (its faults and request log are theirs alone); each on its own
    server, stopped when the block ends (a module's fixture outlives no module)."""
    with fresh_schema(postgres_url) as url:
        sim = Simulator(server_loop.serve(create_simulator_app()))
        servers, gateways = [], []
        try:
            for name in names:
                config = Settings(upstream_url=[sim.url + "/v1"], data_dir=tmp_path_factory.mktemp(name),
                                  database_url=url, replica_id=name, **settings)
                app = create_app(config, {n: "default" for n in Settings.model_fields})  # type: ignore[arg-type]
                sock = bind_loopback()
                servers.append(server_loop.run(start_embedded(app, sock)))
                gateways.append(Gateway(f"http://127.0.0.1:{sock.getsockname()[1]}", app))
            yield gateways[0], gateways[1], sim
        finally:
            for server in reversed(servers):
                server_loop.run(stop_embedded(*server))
