"""Memory held by idle Responses WebSockets, and what ``--ws-max-connections`` caps: not a
timed test, a measurement.

Starts one gateway (``python -m gateway serve``, the built-in simulator) from the source tree
given by ``--repo`` (default: this one, so the same script measures ``main`` and a branch),
then, from one asyncio client process:

1. idle: start-up plus one WebSocket exchange; VmRSS of the gateway;
2. opens ``--connections`` WebSockets; each sends one Codex-like ``response.create`` (an
   ``--input-bytes`` input, ``store: false``) and waits for ``response.completed``, then stays
   open and silent (as Codex between turns); VmRSS with all of them held;
3. closes them all; VmRSS 2 s later.

Extra arguments after ``--`` go to ``serve`` (e.g. ``-- --ws-max-connections 256``).
Prints one JSON object (and writes it to ``bench/results/websockets-<label>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Server, free_port, memory_kib

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"


def mib(kib: int) -> float:
    return round(kib / 1024, 1)


async def one(url: str, frame: str, held: list[Any], outcome: dict[str, int]) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    try:
        ws = await connect(url, max_size=None, open_timeout=60)
    except InvalidStatus as exc:
        key = f"refused_{exc.response.status_code}"
        outcome[key] = outcome.get(key, 0) + 1
        return
    await ws.send(frame)
    while json.loads(await ws.recv())["type"] != "response.completed":
        pass
    held.append(ws)
    outcome["answered"] = outcome.get("answered", 0) + 1


async def phase(url: str, count: int, input_bytes: int, server: Server) -> dict[str, Any]:
    frame = json.dumps({"type": "response.create", "model": "text", "store": False,
                        "input": [{"role": "user", "content": [{"type": "input_text", "text": "x" * input_bytes}]}]})
    held: list[Any] = []
    outcome: dict[str, int] = {}
    started = time.monotonic()
    for start in range(0, count, 50):  # 50 handshakes at a time
        await asyncio.gather(*(one(url, frame, held, outcome) for _ in range(start, min(count, start + 50))))
    opened_s = round(time.monotonic() - started, 1)
    await asyncio.sleep(1)
    held_mib = mib(memory_kib(server.pid)["rss_kib"])
    await asyncio.gather(*(ws.close() for ws in held))
    await asyncio.sleep(2)
    return {"outcome": outcome, "open_s": opened_s, "held_mib": held_mib,
            "after_close_mib": mib(memory_kib(server.pid)["rss_kib"])}


def run(repo: Path, label: str, count: int, input_bytes: int, serve_args: list[str]) -> dict[str, Any]:
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="cb2a-ws-"))
    server = Server(
        "gateway",
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(tmp / "data"),
         "--log-level", "warning", *serve_args],
        port, "/healthz", tmp / "gateway.log", env={"PYTHONPATH": str(repo)}, cwd=repo,
    )
    server.start()
    out: dict[str, Any] = {"label": label, "repo": str(repo), "connections": count, "input_bytes": input_bytes,
                           "serve_args": serve_args}
    try:
        server.wait_ready()
        url = f"ws://127.0.0.1:{port}/v1/responses"
        asyncio.run(phase(url, 1, input_bytes, server))  # warm-up: imports, first request
        time.sleep(1)
        out["idle_mib"] = mib(memory_kib(server.pid)["rss_kib"])
        out.update(asyncio.run(phase(url, count, input_bytes, server)))
        answered = out["outcome"].get("answered", 0)
        if answered:
            out["kib_per_held_connection"] = round((out["held_mib"] - out["idle_mib"]) * 1024 / answered, 1)
    finally:
        server.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=BENCH.parent)
    parser.add_argument("--label", default="branch")
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--input-bytes", type=int, default=16 * 1024)
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    out = run(args.repo.resolve(), args.label, args.connections, args.input_bytes, serve_args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"websockets-{args.label}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
