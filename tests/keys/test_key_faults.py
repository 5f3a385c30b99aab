"""A managed key's reservation when its gateway is SIGKILLed mid-request (issue #40), with
real processes on one SQLite file: the reservation nobody settles stops counting against
``max_concurrent`` within its lease (30 s), not an hour. docs/keys.md, "Leases"."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from gateway.keys.store import LEASE
from tests.conftest import Simulator, wait_for
from tests.processes import GatewayProcess

pytestmark = pytest.mark.faults

ADMIN_TOKEN = "key-faults-admin-token-0123456789"


def gateway(data: Path, simulator: Simulator, tmp_path: Path) -> GatewayProcess:
    return GatewayProcess("--data-dir", str(data), "--upstream-url", simulator.url + "/v1", "--admin-token", ADMIN_TOKEN,
                          "--log-level", "warning", log_dir=tmp_path)


def chat(gw: GatewayProcess, secret: str, model: str = "echo", timeout: float = 30) -> httpx.Response:
    return httpx.post(gw.base_url + "/chat/completions", headers={"authorization": f"Bearer {secret}"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}]}, timeout=timeout)


def test_a_reservation_of_a_killed_gateway_is_released_within_its_lease(simulator: Simulator, tmp_path: Path) -> None:
    data = tmp_path / "data"
    gw = gateway(data, simulator, tmp_path)
    restarted = None
    try:
        gw.wait_healthy()
        created = httpx.post(gw.url + "/admin/api/keys", json={"name": "one-at-a-time", "max_concurrent": 1},
                             headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        assert created.status_code == 201, created.text
        secret = created.json()["key"]
        simulator.clear()
        cut: list[BaseException] = []

        def in_flight() -> None:
            try:
                chat(gw, secret, "echo;ttfb=20")
            except httpx.HTTPError as exc:  # the connection drops with the process
                cut.append(exc)

        hung = threading.Thread(target=in_flight)
        hung.start()
        wait_for(lambda: any(r["path"].endswith("/chat/completions") for r in simulator.requests()), timeout=10)
        gw.proc.send_signal(signal.SIGKILL)  # mid-request: nobody will settle its reservation
        gw.proc.wait(10)
        killed_at = time.monotonic()
        hung.join(30)
        assert len(cut) == 1
        restarted = gateway(data, simulator, tmp_path)
        restarted.wait_healthy()
        refused = chat(restarted, secret)
        if time.monotonic() - killed_at < LEASE - 5:  # still within the lease: the slot is held
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "concurrency_limited", refused.text
        wait_for(lambda: chat(restarted, secret).status_code == 200, timeout=LEASE + 15)  # not an hour
        answered = chat(restarted, secret).json()
        assert answered["choices"][0]["message"]["content"] == "You said: hi"
        assert "Traceback" not in restarted.log()
    finally:
        gw.stop()
        if restarted is not None:
            restarted.stop()
