"""Routing replay (issue #34, docs/routing.md): prefix-cache hit rate and makespan of agent
sessions over several engine replicas, run by hand:

    .venv/bin/python bench/routing.py [--sessions 64 --turns 6 --concurrency 32 --replicas 4]

Each replica is a bench fake (an ASGI app on loopback) that models an engine's prefix
cache: the prompt (roles and contents, ~4 characters a token) cut into 16-token blocks,
each block's hash covering every block before it, an LRU of ``--cache-blocks`` blocks.
A call's cached tokens are its longest run of leading blocks in that cache
(``prompt_tokens_details.cached_tokens`` in its usage); its time is a prefill of the
uncached tokens, one prefill at a time per replica (compute-bound), then a decode that
overlaps with the replica's other calls at full speed up to 8 of them and slows in
proportion past that (a saturated engine). In the second half of the table one replica's
times are 5x from half-way through the calls.

Clients: ``--sessions`` agent sessions of ``--turns`` turns, ``--concurrency`` sessions at
once, a shared ~2k-token system prompt, each turn adding a ~200-token user message and the
~100-token answer to the history. Ways the calls are routed:

- ``ideal``: the hit rate of one infinite cache that saw every call (computed, no run);
- ``client sticky hash``: the client calls replica ``crc32(session) % N`` itself;
- the gateway with ``--routing round-robin`` and with ``cache-aware``, for sessions named
  by rollout route (``/rollouts/{id}/v1``), by header (``x-rollout-id``) or not at all.

Prints one line per way: hit rate, hit rate / ideal, makespan, makespan / round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import tempfile
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.app import create_app
from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
from gateway.settings import Settings

CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
SYSTEM = "You are a careful coding agent working in a sandboxed repository. " * 120  # ~2k tokens


@dataclass
class Costs:
    prefill_us_per_token: float = 200.0  # uncached prompt tokens, one prefill at a time per replica
    decode_ms: float = 400.0  # per call, overlapping with other calls
    decode_batch: int = 8  # calls decoding at once at full speed; past it each is slower in proportion


@dataclass
class Shared:
    """What every replica of one run shares: the ideal cache, the calls served, the slowdown."""

    ideal: set[int] = field(default_factory=set)
    ideal_cached: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    calls: int = 0
    slow_after: int | None = None  # calls served before the slow replica slows down
    slow_replica: int = 0


def blocks(messages: list[dict[str, Any]]) -> list[int]:
    text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages)
    chain, running = [], 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        running = hash((running, text[start:start + BLOCK_CHARS]))
        chain.append(running)
    return chain


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["role"]) + 4 + len(m["content"]) for m in messages) // CHARS_PER_TOKEN


class FakeEngine:
    """One replica: an LRU prefix cache of block hashes and a time cost for what it misses."""

    def __init__(self, index: int, shared: Shared, costs: Costs, capacity: int) -> None:
        self.index = index
        self.shared = shared
        self.costs = costs
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.prefill = asyncio.Lock()
        self.served = 0
        self.decoding = 0

    def _lookup(self, chain: list[int]) -> int:
        hit = 0
        for h in chain:
            if h not in self.cache:
                break
            hit += 1
        for h in reversed(chain):  # shortest prefixes most recent (evicted last)
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return hit

    def _ideal(self, chain: list[int]) -> int:
        hit = 0
        for h in chain:
            if h not in self.shared.ideal:
                break
            hit += 1
        self.shared.ideal.update(chain)
        return hit

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        messages = body["messages"]
        chain = blocks(messages)
        tokens = prompt_tokens(messages)
        cached = min(tokens, self._lookup(chain) * BLOCK_TOKENS)
        shared = self.shared
        shared.ideal_cached += min(tokens, self._ideal(chain) * BLOCK_TOKENS)
        shared.prompt_tokens += tokens
        shared.cached_tokens += cached
        slow = 5.0 if shared.slow_after is not None and shared.calls >= shared.slow_after \
            and self.index == shared.slow_replica else 1.0
        async with self.prefill:
            await asyncio.sleep((tokens - cached) * self.costs.prefill_us_per_token / 1e6 * slow)
        self.decoding += 1
        try:
            await asyncio.sleep(self.costs.decode_ms / 1000 * slow * max(1.0, self.decoding / self.costs.decode_batch))
        finally:
            self.decoding -= 1
        shared.calls += 1
        self.served += 1
        digest = hashlib.sha256(orjson.dumps(messages)).hexdigest()
        answer = f"Ran the step; digest {digest}. " + "Output line. " * 30  # ~100 tokens, same on every replica
        usage = {"prompt_tokens": tokens, "completion_tokens": len(answer) // CHARS_PER_TOKEN,
                 "total_tokens": tokens + len(answer) // CHARS_PER_TOKEN,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.get("model", "bench")}
        frames = [
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": answer}, "finish_reason": None}]},
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {**base, "choices": [], "usage": usage},
        ]
        payload = b"".join(b"data: " + orjson.dumps(f) + b"\n\n" for f in frames) + b"data: [DONE]\n\n"

        async def one() -> Any:
            yield payload

        return StreamingResponse(one(), media_type="text/event-stream")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])


@dataclass
class Way:
    label: str
    routing: str | None  # None: the client calls the replicas itself
    naming: str  # route | header | none | hash


async def run_way(way: Way, args: argparse.Namespace, slow: bool) -> dict[str, float]:
    shared = Shared()
    total_calls = args.sessions * args.turns
    if slow:
        shared.slow_after, shared.slow_replica = total_calls // 2, 0
    engines = [FakeEngine(i, shared, Costs(), args.cache_blocks) for i in range(args.replicas)]
    servers, urls = [], []
    for engine in engines:
        sock = bind_loopback()
        servers.append(await start_embedded(engine.app(), sock))
        urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}/v1")
    gateway = None
    with tempfile.TemporaryDirectory() as data:
        if way.routing is not None:
            settings = Settings(upstream_url=urls, data_dir=Path(data), routing=way.routing,
                                routing_imbalance_rel=args.imbalance_rel, routing_imbalance_abs=args.imbalance_abs,
                                max_concurrent=1024, stream_mode="realtime", log_level="warning")
            app = create_app(settings, {n: "default" for n in Settings.model_fields})  # type: ignore[arg-type]
            sock = bind_loopback()
            gateway = await start_embedded(app, sock)
            gateway_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        gate = asyncio.Semaphore(args.concurrency)
        limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2,
                              keepalive_expiry=4)  # under the gateway's --header-timeout (10 s): never a closed one
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:

            async def session(n: int) -> None:
                sid = f"session-{n}"
                messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
                async with gate:
                    for turn in range(args.turns):
                        messages.append({"role": "user", "content": f"[{sid} turn {turn}] " + f"Look at file {n}-{turn}. " * 40})
                        headers: dict[str, str] = {}
                        if way.naming == "hash":
                            url = urls[zlib.crc32(sid.encode()) % len(urls)]
                        elif way.naming == "route":
                            url = f"{gateway_url}/rollouts/{sid}/v1"
                        else:
                            url = gateway_url + "/v1"
                            if way.naming == "header":
                                headers["x-rollout-id"] = sid
                        body = {"model": "bench", "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}}
                        answer = []
                        async with client.stream("POST", url + "/chat/completions", json=body, headers=headers) as r:
                            r.raise_for_status()
                            async for line in r.aiter_lines():
                                if line.startswith("data: {"):
                                    chunk = orjson.loads(line[6:])
                                    for choice in chunk.get("choices") or ():
                                        answer.append((choice.get("delta") or {}).get("content") or "")
                        messages.append({"role": "assistant", "content": "".join(answer)})

            started = time.perf_counter()
            await asyncio.gather(*(session(n) for n in range(args.sessions)))
            makespan = time.perf_counter() - started
        if gateway is not None:
            await stop_embedded(*gateway)
    for server in servers:
        await stop_embedded(*server)
    return {"hit": shared.cached_tokens / max(1, shared.prompt_tokens),
            "ideal": shared.ideal_cached / max(1, shared.prompt_tokens), "makespan": makespan,
            "spread": [e.served for e in engines]}  # type: ignore[dict-item]


WAYS = [
    Way("client sticky hash", None, "hash"),
    Way("gateway round-robin, unnamed", "round-robin", "none"),
    Way("gateway round-robin, rollout route", "round-robin", "route"),
    Way("gateway cache-aware, rollout route", "cache-aware", "route"),
    Way("gateway cache-aware, x-rollout-id", "cache-aware", "header"),
    Way("gateway cache-aware, unnamed", "cache-aware", "none"),
]


async def main(args: argparse.Namespace) -> None:
    from gateway.observability.logging import configure_logging

    configure_logging("warning")
    for slow in {"both": (False, True), "alike": (False,), "slow": (True,)}[args.scenario]:
        print(f"\n{'one replica 5x slower from half-way' if slow else 'all replicas alike'}: "
              f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} at once, {args.replicas} replicas, "
              f"{args.cache_blocks} blocks of {BLOCK_TOKENS} tokens each; gate rel {args.imbalance_rel}"
              f" abs {args.imbalance_abs}")
        results = {}
        for way in WAYS:
            if args.only and args.only not in way.label:
                continue
            results[way.label] = await run_way(way, args, slow)
        base = results.get("gateway round-robin, unnamed")
        ideal = next(iter(results.values()))["ideal"] if results else 0.0
        print(f"| way | hit rate | of ideal ({ideal:.1%}) | makespan s | vs round-robin | calls per replica |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, r in results.items():
            versus = f"{r['makespan'] / base['makespan']:.2f}x" if base else "-"
            print(f"| {label} | {r['hit']:.1%} | {r['hit'] / ideal:.0%} | {r['makespan']:.2f} | {versus} | "
                  f"{' / '.join(str(s) for s in r['spread'])} |")  # type: ignore[union-attr]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--cache-blocks", type=int, default=2048, help="LRU blocks per replica (16 tokens each)")
    parser.add_argument("--only", help="run only the ways whose label contains this")
    parser.add_argument("--scenario", choices=["both", "alike", "slow"], default="both")
    parser.add_argument("--imbalance-rel", type=float, default=1.5)
    parser.add_argument("--imbalance-abs", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
