"""What commit-before-release costs a rollout call (issue #26), run by hand:

    .venv/bin/python bench/rollouts.py [--calls N]                 # this tree
    PYTHONPATH=/path/to/other/tree .venv/bin/python bench/rollouts.py   # another tree

One in-process gateway (SQLite store in a temp dir) in front of the simulator; sequential
non-streaming and streaming Chat calls of a 3-turn-sized conversation, without a rollout
and with one (``x-rollout-id``; on a tree with rollouts, ``--capture-tokens vllm``, so each
call's record is written to the store before its answer is released). Prints p50/p99 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
from gateway.settings import Settings
from gateway.simulator.server import create_simulator_app

KEY = "bench-rollouts-client-key-0123456789"
MESSAGES = [{"role": "user", "content": "CALL get_weather {\"city\": \"Paris\"} " + "context " * 200}]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(calls: int) -> None:
    from gateway.observability.logging import configure_logging

    configure_logging("warning")
    sim_sock = bind_loopback()
    sim = await start_embedded(create_simulator_app(), sim_sock)
    extra = {"capture_tokens": "vllm"} if "capture_tokens" in Settings.model_fields else {}
    with tempfile.TemporaryDirectory() as data:
        settings = Settings(upstream_url=[f"http://127.0.0.1:{sim_sock.getsockname()[1]}/v1"], data_dir=Path(data),
                            api_key=[KEY], **extra)
        app = create_app(settings, {n: "default" for n in Settings.model_fields})  # type: ignore[arg-type]
        sock = bind_loopback()
        gw = await start_embedded(app, sock)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as client:
            for stream in (False, True):
                for label, headers in (("no rollout", {}), ("rollout", {"x-rollout-id": "bench-r"})):
                    times = []
                    for n in range(calls + 10):
                        started = time.perf_counter()
                        body = {"model": "text", "messages": MESSAGES, "stream": stream}
                        r = await client.post(url, json=body, headers={"authorization": f"Bearer {KEY}", **headers})
                        r.raise_for_status()
                        if n >= 10:  # warm-up left out
                            times.append((time.perf_counter() - started) * 1000)
                    kind = "stream" if stream else "json"
                    print(f"{kind:6} {label:10} p50 {statistics.median(times):6.2f} ms  p99 {pct(times, 0.99):6.2f} ms"
                          f"  (n={calls}, records on: {bool(extra)})")
        await stop_embedded(*gw)
    await stop_embedded(*sim)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    asyncio.run(main(parser.parse_args().calls))
