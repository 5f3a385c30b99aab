"""The gateway as a real subprocess (``python -m gateway serve``), for fault tests that
need its own process: signals, exit codes, a data dir on a filesystem that fills up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx


def readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` has bytes within ``timeout`` s (poll, not select: the session holds
    over a thousand descriptors by its end, past what select takes)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


#: The OS's randomness: a test that seeds ``random`` must not make two workers pick alike.
_PICKS = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free loopback port for a server started later by another process, picked below
    the kernel's ephemeral range. A port from ``bind(0)`` is one any process may be handed
    next: a gateway started in the suite beside this one (``make test`` and ``make
    test-faults`` run together on a busy machine) took a stopped fault-test gateway's port,
    and that test's late client threads then spoke to it. Below the range, only another
    pick like this one can collide, and it probes first."""
    low = 10000
    high = max(low + 1000, _ephemeral_low())
    for _ in range(200):
        port = _PICKS.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {low}-{high - 1}")


def wait_healthy(
    proc: subprocess.Popen[Any], url: str, timeout: float = 30.0, log: Callable[[], str] = lambda: ""
) -> None:
    """Poll ``url``'s ``/healthz`` until it answers 200; fail at once if ``proc`` exits
    (``log``: what to show with the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, f"gateway exited with {proc.returncode}:\n{log()}"
        assert time.monotonic() < deadline, f"gateway not healthy in {timeout} s:\n{log()}"
        time.sleep(0.05)


def children(pid: int) -> set[int]:
    """The worker processes of a ``--workers`` parent (its children running the app)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"resource_tracker" not in cmdline:
                out.add(int(child))
    return out


class GatewayProcess:
    """``codebuddy2api serve`` on a free loopback port; stderr goes to a log file."""

    def __init__(self, *args: str, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"gateway-{self.port}.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(self.port), *args],
            env=clean | (env or {}), stdout=self._log, stderr=subprocess.STDOUT,
        )

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 30.0) -> None:
        wait_healthy(self.proc, self.url, timeout, self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def own_simulator(server_loop: Any) -> Iterator[Any]:
    """A simulator of its own on the session loop whose handlers are cancelled when it
    stops: they may sleep for minutes (stalled-upstream scenarios)."""
    from gateway.http.servers import bind_loopback, start_embedded
    from gateway.simulator.server import create_simulator_app
    from tests.conftest import Simulator

    sock = bind_loopback()
    server, task = server_loop.run(start_embedded(create_simulator_app(), sock))
    try:
        yield Simulator(f"http://127.0.0.1:{sock.getsockname()[1]}")
    finally:

        async def stopped() -> None:
            handlers = list(server.server_state.tasks)  # still sleeping in a stalled scenario
            for handler in handlers:
                handler.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            server.should_exit = True
            await task

        server_loop.run(stopped())


def require_build(missing: list[Path], hint: str) -> None:
    """Skip a real-upstream suite whose build is absent; fail instead when
    ``CODEBUDDY2API_REQUIRE_LLAMA`` is set (CI, where a skip would hide a broken build)."""
    if not missing:
        return
    import pytest

    message = f"no build ({', '.join(map(str, missing))}): run {hint}"
    if os.environ.get("CODEBUDDY2API_REQUIRE_LLAMA"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def upstream_process(argv: list[str], health_url: str, log_path: Path, timeout: float = 120.0) -> Iterator[subprocess.Popen]:
    """A real upstream server (llama-server, llama-cpp-python) as a subprocess, yielded once
    ``health_url`` answers 200; its output goes to ``log_path``; terminated on exit."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert process.poll() is None, f"{argv[0]} exited ({process.returncode}); see {log_path}"
                try:
                    if httpx.get(health_url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"{argv[0]} did not become healthy in {timeout:.0f} s; see {log_path}"
                time.sleep(0.5)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


_PROBE = """
import http.client, json, sys, threading, time
port, took, stretch, stop = int(sys.argv[1]), [], [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/healthz")
    status = conn.getresponse().status
    conn.close()
    took.append((time.perf_counter() - start) * 1000 if status == 200 else float("inf"))
    # the machine's pace now: how long a fixed bit of CPU work takes in wall time over the
    # CPU time it needs (1 on an idle core; ~10 with twenty runnable processes on two)
    wall, cpu, n = time.perf_counter(), time.thread_time(), 0
    while time.thread_time() - cpu < 0.002:
        n += 1
    stretch.append((time.perf_counter() - wall) / max(time.thread_time() - cpu, 1e-6))
    time.sleep(0.01)
print(json.dumps([took, stretch]))
"""


class Probes:
    """One probe process's ``/healthz`` round trips (ms) and, between them, the machine's
    pace: the wall time of a fixed bit of CPU work over its CPU time (``stretch``). A frozen
    event loop delays ``/healthz`` whatever the pace; a busy machine slows every process,
    the gateway's loop too, by about its stretch."""

    def __init__(self) -> None:
        self.gateway: list[float] = []
        self.stretch: list[float] = []

    @property
    def pace(self) -> float:
        """The median stretch while the probes ran (at least 1)."""
        ordered = sorted(self.stretch)
        return max(1.0, ordered[len(ordered) // 2]) if ordered else 1.0

    def stalled(self, bound_ms: float, rank: int) -> float:
        """How far (ms) the gateway's ``rank``-th worst probe is past ``bound_ms`` at the
        machine's pace (0: within). A rank, not the maximum: one late answer is the
        machine's, a frozen loop delays every probe while it lasts."""
        ordered = sorted(self.gateway)
        worst = ordered[-rank] if len(ordered) >= rank else 0.0
        return max(0.0, worst - bound_ms * self.pace)


@contextlib.contextmanager
def paced_probe(port: int) -> Iterator[Probes]:
    """:class:`Probes` of the gateway on ``port`` from a process of its own, for as long as
    the block runs (filled when it ends)."""
    probe = subprocess.Popen([sys.executable, "-c", _PROBE, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    probes = Probes()
    try:
        yield probes
    finally:
        out, _ = probe.communicate(b"", timeout=60)
        took, stretch = json.loads(out)
        probes.gateway.extend(float(t) for t in took)
        probes.stretch.extend(float(t) for t in stretch)


@contextlib.contextmanager
def healthz_probe(port: int) -> Iterator[list[float]]:
    """``/healthz`` round trips (ms; a non-200 is infinite) from a process of its own for
    as long as the block runs: a probe thread in the test process would also time the
    test's own work (building a 28 MiB frame holds the GIL for half a second). The list
    fills when the block ends."""
    with paced_probe(port) as probes:
        yield probes.gateway


#: A ``/healthz`` p99 (ms) past this while an attack runs is a frozen event loop (the attacks
#: froze it for 8-20 s before their fixes). The tighter figures measured on an idle machine
#: (p99 under 100 ms) are bench numbers (bench/hostile.md), not timed tests: on 2 busy cores
#: a healthy gateway's p99 reached 280 ms.
FREEZE_MS = 500.0
