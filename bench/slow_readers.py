"""Memory held for stalled readers, and how far the upstream runs ahead of them: not a
timed test, a measurement.

Starts the simulator (``python -m gateway simulate``, from this tree: it counts the stream
bytes it wrote, ``/stats`` ``bytes_sent``) and one gateway (``python -m gateway serve``) from
the source tree given by ``--repo`` (default: this one, so the same script measures
``main`` and a branch), then from one asyncio client process:

1. idle: one whole streamed answer as warm-up; VmRSS of the gateway;
2. opens ``--readers`` streams (Chat Completions, ``stream: true``) of a large, fast answer
   (``large;size=<--answer-bytes>;chunk=<--chunk>``, 4096 by default); each reads its response headers and at
   most ``--read-bytes`` of the body, then stops reading for ``--stall`` seconds;
3. samples the gateway's VmRSS every second; at the end: its growth over idle and per
   reader, the bytes the simulator wrote, the bytes the clients read;
4. closes them all; VmRSS 3 s later.

The clients keep the kernel's default receive buffers (a real client's): bytes the kernel
holds for a socket count as written by the upstream, not as gateway memory.
Extra arguments after ``--`` go to ``serve`` (e.g. ``-- --stream-mode realtime``).
Prints one JSON object (and writes it to ``bench/results/slow-readers-<label>.json``).
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

from procs import Server, free_port, http_get_json, memory_kib, raise_nofile

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"


def mib(kib: int | float) -> float:
    return round(kib / 1024, 1)


async def sent_bytes(simulator: Server) -> int:
    """The stream bytes the simulator has written (asked off this loop: it may be busy)."""
    stats = await asyncio.to_thread(http_get_json, simulator.base + "/_sim/stats", 60.0)
    return int(stats["bytes_sent"])


def request_bytes(port: int, model: str) -> bytes:
    body = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def stalled_reader(port: int, model: str, read_bytes: int, stalled: asyncio.Event,
                         read: list[int], held: list[asyncio.StreamWriter]) -> None:
    """Send one streamed request, read the headers and up to ``read_bytes`` of the body,
    then read nothing more until the bench is over."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
    held.append(writer)
    writer.write(request_bytes(port, model))
    await writer.drain()
    got = len(await reader.readuntil(b"\r\n\r\n"))
    while got < read_bytes:
        piece = await reader.read(min(4096, read_bytes - got))
        if not piece:
            break
        got += len(piece)
    read.append(got)
    stalled.set()


async def whole_answer(port: int, model: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
    writer.write(request_bytes(port, model).replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nconnection: close\r\n", 1))
    await writer.drain()
    got = 0
    while piece := await reader.read(1 << 16):
        got += len(piece)
    writer.close()
    return got


async def phase(args: argparse.Namespace, gateway: Server, simulator: Server) -> dict[str, Any]:
    model = f"large;size={args.answer_bytes};chunk={args.chunk}"
    read: list[int] = []
    held: list[asyncio.StreamWriter] = []
    sent_before = await sent_bytes(simulator)
    idle_kib = memory_kib(gateway.pid)["rss_kib"]
    started = time.monotonic()
    tasks = [asyncio.create_task(stalled_reader(gateway.port, model, args.read_bytes, asyncio.Event(), read, held))
             for _ in range(args.readers)]
    samples: list[tuple[float, float, int]] = []  # (s, gateway RSS MiB, simulator bytes)
    peak_kib = idle_kib
    while time.monotonic() - started < args.stall:
        await asyncio.sleep(1)
        rss = memory_kib(gateway.pid)["rss_kib"]
        peak_kib = max(peak_kib, rss)
        sent = await sent_bytes(simulator) - sent_before
        samples.append((round(time.monotonic() - started, 1), mib(rss), sent))
    sent = await sent_bytes(simulator) - sent_before
    rss_end = memory_kib(gateway.pid)["rss_kib"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for w in held:
        w.close()
    await asyncio.sleep(3)
    growth = peak_kib - idle_kib
    return {
        "readers": args.readers, "answer_bytes": args.answer_bytes, "stall_s": args.stall,
        "streams_stalled": len(read), "idle_mib": mib(idle_kib), "peak_mib": mib(peak_kib),
        "end_mib": mib(rss_end), "growth_mib": mib(growth), "growth_kib_per_reader": round(growth / args.readers, 1),
        "upstream_wrote_mib": round(sent / 2**20, 1), "upstream_kib_per_reader": round(sent / 1024 / args.readers, 1),
        "clients_read_kib": round(sum(read) / 1024, 1),
        "after_close_mib": mib(memory_kib(gateway.pid)["rss_kib"]),
        "samples": samples[:: max(1, len(samples) // 10)],
    }


def run(args: argparse.Namespace, serve_args: list[str]) -> dict[str, Any]:
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="cb2a-slow-"))
    sim_port, port = free_port(), free_port()
    simulator = Server("simulator", [sys.executable, "-m", "gateway", "simulate", "--port", str(sim_port)],
                       sim_port, "/healthz", tmp / "simulator.log", env={"PYTHONPATH": str(BENCH.parent)}, cwd=BENCH.parent)
    gateway = Server(
        "gateway",
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(tmp / "data"),
         "--upstream-url", f"http://127.0.0.1:{sim_port}/v1", "--max-concurrent", str(args.readers + 16),
         "--max-connections-per-ip", str(args.readers + 64), "--upstream-max-connections", str(args.readers + 16),
         "--log-level", "warning", *serve_args],
        port, "/healthz", tmp / "gateway.log", env={"PYTHONPATH": str(args.repo)}, cwd=args.repo,
    )
    out: dict[str, Any] = {"label": args.label, "repo": str(args.repo), "serve_args": serve_args}
    simulator.start()
    gateway.start()
    try:
        simulator.wait_ready()
        gateway.wait_ready()
        out["warm_up_bytes"] = asyncio.run(whole_answer(port, "large;size=200000;chunk=4096"))
        time.sleep(1)
        out.update(asyncio.run(phase(args, gateway, simulator)))
    finally:
        gateway.stop()
        simulator.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=BENCH.parent)
    parser.add_argument("--label", default="branch")
    parser.add_argument("--readers", type=int, default=200)
    parser.add_argument("--answer-bytes", type=int, default=2_000_000, help="text bytes of each answer")
    parser.add_argument("--chunk", type=int, default=4096, help="text characters per upstream chunk (engines: ~4, a token)")
    parser.add_argument("--read-bytes", type=int, default=400, help="body bytes each client reads before it stalls")
    parser.add_argument("--stall", type=float, default=30.0, help="seconds the readers stay stalled")
    args, serve_args = parser.parse_known_args()
    args.repo = args.repo.resolve()
    serve_args = [a for a in serve_args if a != "--"]
    out = run(args, serve_args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"slow-readers-{args.label}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
