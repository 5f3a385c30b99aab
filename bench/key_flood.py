"""One key's flood against another key's latency (issue #36): not a timed test, a measurement.

Starts the built-in simulator (``python -m gateway simulate``) and one gateway in front of
it (``serve --upstream-url``, a store in a temporary data dir) from the source tree given by
``--repo`` (default: this one; ``git archive main | tar -x -C /tmp/main`` measures main).
Two managed keys through the admin API: A with ``rpm: 1`` (the flooder: everything past
its first request is refused), B with ``rpm`` and ``daily_tokens`` far from its use (so
every B request makes a reservation in the store, as a limited tenant's does).

1. baseline: key B alone, ``--b-concurrency`` loops of streamed Chat requests (a 2,000
   character answer in 64-character chunks, 10 ms apart: ~0.35 s each) for ``--seconds``;
2. flood: the same B load while key A floods from a process of its own (niced: the attacker
   is another host in real life), ``--flood-connections`` loops each sending, in turn, a
   Chat request, a ``count_tokens``, a Responses request, a bad body, and a WebSocket
   upgrade with one ``response.create`` frame.

``/healthz`` is asked every 20 ms throughout. Reports B's p50/p99 per phase and their
ratio, ``/healthz`` p50/p99/max per phase, A's answers by status and its request rate.
Prints one JSON object (and writes ``bench/results/key_flood-<label>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Server, cpu_seconds, free_port, raise_nofile

ADMIN = "bench-key-flood-admin-token-0001"
B_MODEL = "large;size=2000;chunk=64;delay=0.01"
MESSAGES = [{"role": "user", "content": "hello there"}]


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (ms, one decimal)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 1)


# -- key B and /healthz (this process) ------------------------------------------------------


async def b_loop(client: httpx.AsyncClient, key: str, until: float, took: list[float], errors: list[str]) -> None:
    while time.monotonic() < until:
        began = time.monotonic()
        try:
            async with client.stream("POST", "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                     json={"model": B_MODEL, "messages": MESSAGES, "stream": True}) as response:
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
            if response.status_code != 200 or b"[DONE]" not in body:
                errors.append(f"{response.status_code} {body[:120]!r}")
                continue
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)
            continue
        took.append((time.monotonic() - began) * 1000)


async def healthz_loop(client: httpx.AsyncClient, until: float, took: list[float]) -> None:
    while time.monotonic() < until:
        began = time.monotonic()
        try:
            ok = (await client.get("/healthz")).status_code == 200
        except httpx.HTTPError:
            ok = False
        took.append((time.monotonic() - began) * 1000 if ok else math.inf)
        await asyncio.sleep(0.02)


async def phase(base: str, key_b: str, seconds: float, concurrency: int) -> dict[str, Any]:
    took: list[float] = []
    health: list[float] = []
    errors: list[str] = []
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client, \
            httpx.AsyncClient(base_url=base, timeout=60) as probe:
        await asyncio.gather(*(b_loop(client, key_b, until, took, errors) for _ in range(concurrency)),
                             healthz_loop(probe, until, health))
    return {"b_requests": len(took), "b_errors": len(errors), "b_error_samples": errors[:3],
            "b_p50_ms": pct(took, 0.5), "b_p99_ms": pct(took, 0.99), "b_max_ms": pct(took, 1.0),
            "healthz_samples": len(health), "healthz_p50_ms": pct(health, 0.5),
            "healthz_p99_ms": pct(health, 0.99), "healthz_max_ms": pct(health, 1.0)}


# -- key A's flood (a process of its own) ---------------------------------------------------


def _request(path: str, key: str, body: bytes, port: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    """One HTTP/1.1 response off a kept-alive connection: its status (body read and dropped)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        await reader.readuntil(b"\r\n0\r\n\r\n")
    else:
        length = int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]) if b"content-length:" in lower else 0
        await reader.readexactly(length)
    return status


async def _ws_once(port: int, key: str) -> str:
    """A Responses WebSocket upgrade and one ``response.create`` frame; the first answer's
    status or error code (a refused upgrade: its HTTP status)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write((f"GET /v1/responses HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {key}\r\n"
                      "upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\n"
                      f"sec-websocket-key: {base64.b64encode(os.urandom(16)).decode()}\r\n\r\n").encode())
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 101:
            return str(status)
        payload = json.dumps({"type": "response.create", "model": "text", "input": "hi"}).encode()
        mask = os.urandom(4)
        writer.write(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        first = await reader.readexactly(2)
        size = first[1] & 0x7F
        if size == 126:
            size = int.from_bytes(await reader.readexactly(2), "big")
        elif size == 127:
            size = int.from_bytes(await reader.readexactly(8), "big")
        event = json.loads(await reader.readexactly(size))
        return str(event.get("status") or (event.get("error") or {}).get("code") or event.get("type"))
    finally:
        writer.close()


async def flood(base: str, key: str, seconds: float, connections: int) -> dict[str, Any]:
    """Raw HTTP/1.1 on kept-alive sockets (and raw WebSocket upgrades): the flooder's own
    CPU per request is a small fraction of httpx's, so on a shared 2-core machine what is
    measured is the gateway's cost of the flood, not the client's."""
    port = int(base.rsplit(":", 1)[1])
    statuses: dict[str, int] = {}
    until = time.monotonic() + seconds
    chat = json.dumps({"model": "text", "messages": MESSAGES}).encode()
    kinds = [
        ("chat", _request("/v1/chat/completions", key, chat, port)),
        ("count_tokens", _request("/v1/messages/count_tokens", key, chat, port)),
        ("responses", _request("/v1/responses", key, json.dumps({"model": "text", "input": "hi", "stream": True}).encode(), port)),
        ("bad_body", _request("/v1/chat/completions", key, b'{"model": 5, "messages": "x"}', port)),
        ("ws_frame", b""),
    ]

    def note(kind: str, status: Any) -> None:
        name = f"{kind} {status}"
        statuses[name] = statuses.get(name, 0) + 1

    async def loop(start: int) -> None:
        n = start
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < until:
            kind, raw = kinds[n % len(kinds)]
            n += 1
            try:
                if kind == "ws_frame":
                    async with asyncio.timeout(10):
                        note(kind, await _ws_once(port, key))
                    continue
                writer.write(raw)
                async with asyncio.timeout(30):
                    note(kind, await _read_response(reader))
            except Exception as exc:  # a closed connection: note it, open another
                note(kind, type(exc).__name__)
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()

    began = time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(connections)))
    total = sum(statuses.values())
    return {"a_requests": total, "a_per_second": round(total / (time.monotonic() - began), 1),
            "a_statuses": dict(sorted(statuses.items()))}


def flooder_main(base: str, key: str, seconds: float, connections: int, nice: int) -> int:
    os.nice(nice)  # the attacker is another host in real life: it yields the cores to the gateway
    print(json.dumps(asyncio.run(flood(base, key, seconds, connections))))
    return 0


# -- the run -----------------------------------------------------------------------------------


def create_key(base: str, **fields: Any) -> dict[str, Any]:
    r = httpx.post(base + "/admin/api/keys", json=fields, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def run(repo: Path, label: str, seconds: float, b_concurrency: int, connections: int, nice: int) -> dict[str, Any]:
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="cb2a-key-flood-"))
    sim_port, port = free_port(), free_port()
    env = {"PYTHONPATH": str(repo)}
    sim = Server("simulator", [sys.executable, "-m", "gateway", "simulate", "--port", str(sim_port)], sim_port, None,
                 tmp / "sim.log", env=env, cwd=repo)
    gateway = Server(
        "gateway",
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--admin-token", ADMIN,
         "--upstream-url", f"http://127.0.0.1:{sim_port}/v1", "--data-dir", str(tmp / "data"), "--log-level", "warning"],
        port, "/healthz", tmp / "gateway.log", env=env, cwd=repo,
    )
    sim.start()
    out: dict[str, Any] = {"label": label, "repo": str(repo), "seconds": seconds, "b_concurrency": b_concurrency,
                           "flood_connections": connections, "flooder_nice": nice, "b_model": B_MODEL}
    try:
        sim.wait_ready()
        gateway.start()
        gateway.wait_ready()
        key_a = create_key(gateway.base, name="flooder", rpm=1)
        key_b = create_key(gateway.base, name="tenant-b", rpm=100_000, daily_tokens=1_000_000_000)
        asyncio.run(phase(gateway.base, key_b["key"], 3, b_concurrency))  # warm-up (imports, pools)
        cpu = cpu_seconds(gateway.pid)
        out["baseline"] = asyncio.run(phase(gateway.base, key_b["key"], seconds, b_concurrency))
        out["baseline"]["gateway_cpu_s"] = round(cpu_seconds(gateway.pid) - cpu, 2)
        flooder = subprocess.Popen([sys.executable, __file__, "--flooder", gateway.base, key_a["key"], str(seconds + 2),
                                    str(connections), str(nice)], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the flood is under way (its first requests included) before B is timed
        cpu = cpu_seconds(gateway.pid)
        out["flood"] = asyncio.run(phase(gateway.base, key_b["key"], seconds, b_concurrency))
        out["flood"]["gateway_cpu_s"] = round(cpu_seconds(gateway.pid) - cpu, 2)
        flood_out, _ = flooder.communicate(timeout=seconds + 60)
        out["flooder"] = json.loads(flood_out.strip().splitlines()[-1])
        # the gateway's CPU per flood request: what the flood cost it beyond B's own load
        extra = out["flood"]["gateway_cpu_s"] - out["baseline"]["gateway_cpu_s"]
        out["cpu_ms_per_flood_request"] = round(extra * 1000 / max(1, out["flooder"]["a_per_second"] * seconds), 2)
        base_p99, flood_p99 = out["baseline"]["b_p99_ms"], out["flood"]["b_p99_ms"]
        out["b_p99_ratio"] = round(flood_p99 / base_p99, 2) if base_p99 and flood_p99 else None
        out["load_average"] = os.getloadavg()
    finally:
        gateway.stop()
        sim.stop()
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--flooder":
        base, key, seconds, connections = sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
        return flooder_main(base, key, seconds, connections, int(sys.argv[6]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="source tree whose gateway is measured")
    parser.add_argument("--label", default="current")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--b-concurrency", type=int, default=4)
    parser.add_argument("--flood-connections", type=int, default=64)
    parser.add_argument("--flooder-nice", type=int, default=10,
                        help="the flooder's niceness (0: it competes with the gateway for the cores)")
    args = parser.parse_args()
    result = run(args.repo.resolve(), args.label, args.seconds, args.b_concurrency, args.flood_connections,
                 args.flooder_nice)
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"key_flood-{args.label}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
