"""Hostile clients of sockets and connections (issue #25), shared by the tests and
``bench/hostile.py``: each talks to a gateway on loopback only and reports what it got.

Run as ``python -m tests.socket_attacks URL SECONDS [KEY [SOURCE]]`` it keeps the cheap attacks going for
SECONDS (keyless and cross-origin upgrades, slow headers, ignored frames) in a process of its
own, so a test can measure ``/healthz`` meanwhile without sharing a GIL with the attackers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

#: The source address attackers connect from (None: the system's choice, 127.0.0.1 on loopback);
#: another loopback address (127.0.0.2) makes them another client than the test's own probes.
SOURCE: str | None = None


def _local() -> dict[str, Any]:
    return {"local_addr": (SOURCE, 0)} if SOURCE else {}


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/responses"


def tiny_items_frame(items: int = 1_000_000, content: str = "x") -> bytes:
    """A ``response.create`` prewarm (``generate: false``) of ``items`` input messages of
    ``content``: 28.6 MiB for a million tiny ones, 72,866 bytes on the wire with
    permessage-deflate (past the 50,000-item limit: refused by name since issue #25)."""
    return orjson.dumps({"type": "response.create", "model": "text", "generate": False, "store": False,
                         "input": [{"role": "user", "content": content}] * items})


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def big_frames(url: str, sockets: int = 3, items: int = 1_000_000, headers: dict[str, str] | None = None,
                     content: str = "x") -> tuple[list[Any], list[dict[str, Any]]]:
    """Open ``sockets`` WebSockets, each sends one big prewarm frame and reads its answer;
    returns the open connections (the caller closes them) and each answer's last event."""
    frame = tiny_items_frame(items, content).decode()
    opened: list[Any] = []
    answers: list[dict[str, Any]] = []
    for _ in range(sockets):  # one at a time: the gateway parses each on its loop
        ws = await connect(ws_url(url), additional_headers=headers or {}, max_size=None, open_timeout=30, **_local())
        opened.append(ws)
        await ws.send(frame)
        answers.append(await terminal(ws))
    return opened, answers


async def terminal(ws: Any) -> dict[str, Any]:
    """The events of one answer up to its terminal (or a wrapped error, or the close)."""
    event: dict[str, Any] = {"type": "closed"}
    with contextlib.suppress(ConnectionClosed):
        while event["type"] not in ("response.completed", "error", "response.failed"):
            event = json.loads(await asyncio.wait_for(ws.recv(), 300))
    return event


async def keyless_upgrades(url: str, count: int, held: list[Any] | None = None, at_once: int = 64) -> dict[str, int]:
    """``count`` upgrades without a client key, ``at_once`` at a time: statuses (101 = accepted;
    the accepted sockets go to ``held`` when given, else they are closed at once)."""
    statuses: dict[str, int] = {}
    gate = asyncio.Semaphore(at_once)

    async def one() -> None:
        async with gate:
            try:
                ws = await connect(ws_url(url), open_timeout=30, **_local())
                status = "101"
                if held is not None:
                    held.append(ws)
                else:
                    await ws.close()
            except InvalidStatus as exc:
                status = str(exc.response.status_code)
            except InvalidMessage:  # closed before any answer: the niced attacker, on a loaded
                status = "closed"  # machine, sent its handshake after the gateway's header timeout
            except (OSError, asyncio.TimeoutError):
                status = "error"
            statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(one() for _ in range(count)))
    return statuses


async def cross_origin_upgrades(url: str, count: int) -> dict[str, int]:
    statuses: dict[str, int] = {}
    for _ in range(count):
        try:
            ws = await connect(ws_url(url), origin="http://evil.example", open_timeout=30, **_local())  # type: ignore[arg-type]
            await ws.close()
            status = "101"
        except InvalidStatus as exc:
            status = str(exc.response.status_code)
        statuses[status] = statuses.get(status, 0) + 1
    return statuses


async def slow_headers(host: str, port: int, sockets: int, interval: float, seconds: float) -> dict[str, Any]:
    """``sockets`` connections each sending one header line every ``interval`` seconds for
    ``seconds``: how many the server closed, and after how long (median)."""
    closed_after: list[float] = []

    async def one() -> None:
        start = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection(host, port, **_local())
        except OSError:
            return
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            i = 0
            while time.monotonic() - start < seconds:
                with contextlib.suppress(asyncio.TimeoutError):
                    if await asyncio.wait_for(reader.read(65536), interval) == b"":
                        closed_after.append(time.monotonic() - start)
                        return
                writer.write(f"x-slow-{i}: {i}\r\n".encode())
                await writer.drain()
                i += 1
        except (ConnectionError, OSError):
            closed_after.append(time.monotonic() - start)
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(sockets)))
    closed_after.sort()
    median = closed_after[len(closed_after) // 2] if closed_after else None
    return {"sockets": sockets, "closed": len(closed_after), "median_closed_after_s": median and round(median, 2),
            "last_closed_after_s": closed_after and round(closed_after[-1], 2) or None}


async def ignored_frames(url: str, seconds: float, headers: dict[str, str] | None = None) -> float | None:
    """A socket that only ever sends ``response.processed``: seconds until the server closed
    it (None: still open after ``seconds``)."""
    start = time.monotonic()
    async with connect(ws_url(url), additional_headers=headers or {}, **_local()) as ws:
        try:
            while time.monotonic() - start < seconds:
                await ws.send(json.dumps({"type": "response.processed", "response_id": "resp_x"}))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ws.recv(), 0.5)
        except ConnectionClosed:
            return time.monotonic() - start
    return None


async def keep_attacking(url: str, seconds: float, key: str | None = None) -> dict[str, Any]:
    """The cheap attacks, over and over, for ``seconds``: keyless upgrades 8 at a time,
    cross-origin upgrades one at a time, 200 slow-header sockets, one ignored-frames socket (``key``: the client key the
    ignored-frames socket presents, when the gateway has one)."""
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + seconds
    rounds = {"keyless": 0, "cross_origin": 0}

    async def loop(name: str, attack: Any) -> None:
        while time.monotonic() < deadline:
            await attack()
            rounds[name] += 1
            await asyncio.sleep(0.05)

    _, _, slow, ignored = await asyncio.gather(
        loop("keyless", lambda: keyless_upgrades(url, 32, at_once=8)),
        loop("cross_origin", lambda: cross_origin_upgrades(url, 16)),
        slow_headers(host, int(port), 200, 1.0, seconds),
        ignored_frames(url, seconds, {"authorization": f"Bearer {key}"} if key else None),
    )
    return {"rounds": rounds, "slow_headers": slow, "ignored_frames_closed_after_s": ignored}


if __name__ == "__main__":  # URL SECONDS [KEY [SOURCE]]
    import os

    os.nice(10)  # a real attacker has CPUs of its own: here it must not take the gateway's share of two
    SOURCE = sys.argv[4] if len(sys.argv) > 4 else None
    print(json.dumps(asyncio.run(keep_attacking(sys.argv[1], float(sys.argv[2]), *sys.argv[3:4]))))
