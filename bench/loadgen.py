"""Load generator, run as its own process so its CPU never counts against a target.

Reads one JSON command per line on stdin, answers one JSON line on stdout:

- ``{"op": "run", "url", "body", "protocol", "concurrency", "requests"}`` -> per-request
  timings (plain first byte, first content-bearing byte, total), bytes, frames, ok.
- ``{"op": "hold", "url", "body", "n", "timeout"}`` -> opens ``n`` streams and answers once
  all have their response headers (or the timeout passed); they stay open until
  ``{"op": "release"}``, which cancels them all.
- ``{"op": "quit"}``.

Every loop is bounded by a request count and a timeout; only loopback URLs are accepted.
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

#: The first frame that carries answer content, per client protocol.
CONTENT = {
    "chat": re.compile(rb'"content":\s*"[^"]'),
    "messages": re.compile(rb"content_block_delta"),
    "responses": re.compile(rb"response\.output_text\.delta"),
}
#: The protocol's normal terminal frame: a stream without it is counted as failed.
END = {"chat": b"[DONE]", "messages": b"message_stop", "responses": b"response.completed"}
CARRY = 96  # bytes kept from the previous read so a marker split across reads is found
REQUEST_TIMEOUT = 60.0


def raise_nofile(want: int = 8192) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise SystemExit(f"loadgen: refusing non-loopback target {url}")


async def one_request(
    client: httpx.AsyncClient, url: str, body: bytes, protocol: str, headers: dict[str, str]
) -> dict[str, Any]:
    content_re, end = CONTENT[protocol], END[protocol]
    out: dict[str, Any] = {"ok": False, "status": None, "first": None, "content": None, "total": None,
                           "bytes": 0, "frames": 0}
    tail = b""
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            out["status"] = resp.status_code
            async for raw in resp.aiter_raw():
                if not raw:
                    continue
                now = time.perf_counter()
                if out["first"] is None:
                    out["first"] = now - start
                out["bytes"] += len(raw)
                out["frames"] += raw.count(b"data:")
                window = tail + raw
                if out["content"] is None and content_re.search(window):
                    out["content"] = now - start
                tail = window[-CARRY:]
                if end in window:
                    out["ended"] = True
        out["total"] = time.perf_counter() - start
        out["ok"] = resp.status_code == 200 and bool(out.get("ended"))
    except (httpx.HTTPError, OSError) as exc:
        out["error"] = type(exc).__name__
        out["total"] = time.perf_counter() - start
    return out


async def run_load(cmd: dict[str, Any]) -> dict[str, Any]:
    url, protocol = cmd["url"], cmd["protocol"]
    check_loopback(url)
    body = json.dumps(cmd["body"]).encode()
    headers = {"content-type": "application/json", **cmd.get("headers", {})}
    concurrency, total = int(cmd["concurrency"]), int(cmd["requests"])
    results: list[dict[str, Any]] = []
    todo = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(REQUEST_TIMEOUT, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            for _ in todo:
                results.append(await one_request(client, url, body, protocol, headers))

        started = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(*(worker() for _ in range(concurrency))), timeout=cmd.get("timeout", 300)
        )
        wall = time.perf_counter() - started
    return {"results": results, "wall": wall}


class Holder:
    """Many open streams at once (for memory with N concurrent streams)."""

    def __init__(self) -> None:
        self.client: httpx.AsyncClient | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.opened = 0
        self.failed = 0

    async def hold(self, cmd: dict[str, Any]) -> dict[str, Any]:
        url, n = cmd["url"], int(cmd["n"])
        check_loopback(url)
        body = json.dumps(cmd["body"]).encode()
        headers = {"content-type": "application/json", **cmd.get("headers", {})}
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0, connect=30.0))
        all_open = asyncio.Event()

        async def stream() -> None:
            assert self.client is not None
            counted = False
            try:
                async with self.client.stream("POST", url, content=body, headers=headers) as resp:
                    if resp.status_code == 200:
                        self.opened += 1
                    else:
                        self.failed += 1
                    counted = True
                    if self.opened + self.failed >= n:
                        all_open.set()
                    async for _ in resp.aiter_raw():
                        pass
            except (httpx.HTTPError, OSError):
                if not counted:
                    self.failed += 1
                    if self.opened + self.failed >= n:
                        all_open.set()

        started = time.perf_counter()
        self.tasks = [asyncio.create_task(stream()) for _ in range(n)]
        try:
            await asyncio.wait_for(all_open.wait(), timeout=float(cmd.get("timeout", 60)))
        except TimeoutError:
            pass
        return {"opened": self.opened, "failed": self.failed, "ramp_s": time.perf_counter() - started}

    async def release(self) -> dict[str, Any]:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()
        self.tasks, self.client = [], None
        result = {"opened": self.opened, "failed": self.failed}
        self.opened = self.failed = 0
        return result


async def main() -> None:
    raise_nofile()
    holder = Holder()
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "run":
            reply = await run_load(cmd)
        elif op == "hold":
            reply = await holder.hold(cmd)
        elif op == "release":
            reply = await holder.release()
        elif op == "quit":
            break
        else:
            reply = {"error": f"unknown op {op!r}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    await holder.release()


if __name__ == "__main__":
    asyncio.run(main())
