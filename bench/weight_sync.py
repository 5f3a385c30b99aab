"""What a weight sync adds to a call's latency (issue #35), over real HTTP on loopback:
the simulator (vLLM's dev RL API) behind an in-process gateway with ``--engine-api vllm``.

- **held**: a call that arrives while the gateway holds (``POST /admin/api/engines/pause``)
  and is released by the resume: the time from the resume's answer to the call's last
  byte, next to the same call's whole time unheld (the baseline).
- **continued**: a call the engine aborts mid-answer (``/pause?mode=abort`` then
  ``/resume`` at once, on the simulator directly): its whole time minus the same answer's
  time without the abort (its continuation waits for the ``/is_paused`` poll, then sends
  the prompt + partial answer again).
- **seam**: the same abort (paused 50 ms, then resumed), behind a realtime gateway without
  token ids (the continuation goes through chat with the partial answer as a prefill) and
  one with ``--capture-tokens vllm`` (through the engine's ``/v1/completions`` with the
  prompt ids + the partial answer's ids): the time from the resume's answer to the first
  byte of the continuation at the client.

``python bench/weight_sync.py`` prints one JSON object (milliseconds, medians of ROUNDS).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.app import create_app  # noqa: E402
from gateway.http.servers import bind_loopback, start_embedded, stop_embedded  # noqa: E402
from gateway.observability.logging import configure_logging  # noqa: E402
from gateway.settings import Settings  # noqa: E402
from gateway.simulator.server import create_simulator_app  # noqa: E402

ROUNDS = 15
FAST = "text"  # 13 chunks at once
SLOW = "text;chunk=2;delay=0.01"  # 52 chunks, 10 ms apart


async def _serve(app: Any) -> tuple[str, Any]:
    sock = bind_loopback()
    server = await start_embedded(app, sock)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


async def _call(client: httpx.AsyncClient, url: str, model: str) -> float:
    """One streamed chat call to its last byte; the monotonic time it ended."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        text = b"".join([chunk async for chunk in response.aiter_bytes()])
    assert b"[DONE]" in text and b'"abort"' not in text
    return time.monotonic()


async def _timed(client: httpx.AsyncClient, url: str, model: str) -> float:
    start = time.monotonic()
    return (await _call(client, url, model)) - start


def _gateway_app(simulator_url: str, data: str, **overrides: Any) -> Any:
    settings = Settings(upstream_url=[simulator_url + "/v1"], engine_api="vllm", data_dir=Path(data),
                        keepalive_interval=5.0, spill_max_bytes=1 << 20, **overrides)
    return create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]


async def main() -> dict[str, Any]:
    configure_logging("warning")  # no request line per call
    simulator_url, simulator = await _serve(create_simulator_app())
    with tempfile.TemporaryDirectory() as data, tempfile.TemporaryDirectory() as data2, \
            tempfile.TemporaryDirectory() as data3:
        app = _gateway_app(simulator_url, data)
        gateway_url, gateway = await _serve(app)
        prefill_url, prefill = await _serve(_gateway_app(simulator_url, data2, stream_mode="realtime"))
        token_url, token = await _serve(_gateway_app(simulator_url, data3, stream_mode="realtime",
                                                     capture_tokens="vllm"))
        admin = {"authorization": f"Bearer {app.state.admin_access.token}"}
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                out = await _measure(client, gateway_url, simulator_url, admin, app)
                for name, url in (("prefill", prefill_url), ("token_in", token_url)):
                    seams = [await _seam(client, url, simulator_url) for _ in range(3 + ROUNDS)][3:]
                    out[f"seam_{name}_ms"] = round(statistics.median(seams) * 1000.0, 1)
                    out[f"seam_{name}_ms_p90"] = round(sorted(seams)[int(0.9 * (ROUNDS - 1))] * 1000.0, 1)
                return out
        finally:
            for server in (gateway, prefill, token):
                await stop_embedded(*server)
            await stop_embedded(*simulator)


async def _seam(client: httpx.AsyncClient, url: str, engine: str) -> float:
    """One slow call aborted halfway: seconds from the resume's answer to the next
    content byte the client reads (the continuation's first)."""
    body = {"model": SLOW, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    arrivals: list[float] = []

    async def read() -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    arrivals.append(time.monotonic())

    call = asyncio.create_task(read())
    while len(arrivals) < 20:
        await asyncio.sleep(0.002)
    await client.post(engine + "/pause", params={"mode": "abort"})
    await asyncio.sleep(0.05)
    await client.post(engine + "/resume")
    resumed = time.monotonic()
    await call
    return min(t for t in arrivals if t > resumed) - resumed


async def _measure(client: httpx.AsyncClient, url: str, engine: str, admin: dict[str, str], app: Any) -> dict[str, Any]:
    for _ in range(3):  # warm the pools
        await _timed(client, url, FAST)
    fast = statistics.median([await _timed(client, url, FAST) for _ in range(ROUNDS)])
    slow = statistics.median([await _timed(client, url, SLOW) for _ in range(ROUNDS)])
    held, continued = [], []
    for _ in range(ROUNDS):
        await client.post(url + "/admin/api/engines/pause", json={}, headers=admin)
        call = asyncio.create_task(_call(client, url, FAST))
        while app.state.engines.hold.held_total < 1:
            await asyncio.sleep(0.001)
        await client.post(url + "/admin/api/engines/resume", json={}, headers=admin)
        resumed = time.monotonic()
        held.append((await call) - resumed)
    for _ in range(ROUNDS):
        start = time.monotonic()
        call = asyncio.create_task(_call(client, url, SLOW))
        await asyncio.sleep(slow / 2)
        await client.post(engine + "/pause", params={"mode": "abort"})
        await client.post(engine + "/resume")
        continued.append((await call) - start - slow)
    ms = 1000.0
    return {
        "rounds": ROUNDS,
        "baseline_fast_call_ms": round(fast * ms, 1),
        "baseline_slow_call_ms": round(slow * ms, 1),
        "held_call_done_ms_after_resume": round(statistics.median(held) * ms, 1),
        "continued_call_added_ms": round(statistics.median(continued) * ms, 1),
        "continued_call_added_ms_p90": round(sorted(continued)[int(0.9 * (ROUNDS - 1))] * ms, 1),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
