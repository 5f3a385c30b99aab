"""Micro-measurements behind the proposed optimizations in docs/performance.md.

Each prices one stage of the gateway's per-chunk or per-request path in isolation (no
servers), so a proposal says what it can save at most. Run by ``bench/run.py`` after the
servers have stopped; also runnable alone (prints JSON).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

FRAME = {
    "id": "chatcmpl-sim-0cb8e121c4d1414f", "object": "chat.completion.chunk", "created": 1795965142,
    "model": "large;size=2048;chunk=16;delay=0.002",
    "choices": [{"index": 0, "delta": {"content": "Hello from the c"}, "finish_reason": None}],
}
RAW = ("data: " + json.dumps(FRAME) + "\n\n").encode()
N = 20000


def per_call_us(fn: Callable[[int], None], n: int = N) -> float:
    fn(50)
    start = time.perf_counter()
    fn(n)
    return (time.perf_counter() - start) / n * 1e6


def sse_httpx_sse(n: int) -> None:
    """What httpx-sse does per network read: decode to str, split lines, build an event."""
    from httpx_sse._decoders import SSEDecoder, SSELineDecoder

    lines, dec = SSELineDecoder(), SSEDecoder()
    for _ in range(n):
        for line in lines.decode(RAW.decode("utf-8")):
            event = dec.decode(line)
            if event is not None:
                _ = event.data


def sse_gateway_parser(n: int) -> None:
    """What the gateway does per network read now: ``SSEDataParser.feed`` on the raw bytes."""
    from gateway.upstream.sse import SSEDataParser

    parser = SSEDataParser()
    for _ in range(n):
        for data in parser.feed(RAW):
            _ = data


def json_loads(n: int) -> None:
    data = RAW[6:-2]
    for _ in range(n):
        orjson.loads(data)


def pipeline(protocol: str) -> Callable[[int], None]:
    """accumulator.feed + realtime scheduler + the room's encoder, one text chunk at a time."""
    from gateway.protocols.chat import ChatRoom
    from gateway.protocols.messages.room import MessagesRoom
    from gateway.protocols.responses.room import ResponsesRoom
    from gateway.store.db import Database
    from gateway.store.responses import ResponseStore
    from gateway.stream.accumulator import ChatSSEAccumulator
    from gateway.stream.realtime import RealtimeScheduler

    tmp = Path(tempfile.mkdtemp(prefix="cb2a-micro-"))
    rooms: dict[str, tuple[Any, bytes]] = {
        "chat": (ChatRoom(), b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'),
        "messages": (MessagesRoom(),
                     b'{"model":"m","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"hi"}]}'),
        "responses": (ResponsesRoom(ResponseStore(Database(tmp / "micro.sqlite3"))), b'{"model":"m","stream":true,"input":"hi"}'),
    }
    room, body = rooms[protocol]

    def run(n: int) -> None:
        parsed = room.parse(body, {})
        acc = ChatSSEAccumulator(0, parsed.rules)
        scheduler = RealtimeScheduler(room.sequential_blocks)
        encoder = room.encoder(parsed, room.new_response_id())
        encoder.start()
        for _ in range(n):
            pieces = acc.feed(orjson.loads(RAW[6:-2]))
            if pieces:
                b"".join(encoder.encode(e) for e in scheduler.push(pieces))

    return run


def parse_request(protocol: str) -> Callable[[int], None]:
    """The room's parse (validation + translation) of a one-message request."""
    from gateway.protocols.chat import ChatRoom
    from gateway.protocols.messages.room import MessagesRoom

    room, body = {
        "chat": (ChatRoom(), b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'),
        "messages": (MessagesRoom(),
                     b'{"model":"m","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"hi"}]}'),
    }[protocol]

    def run(n: int) -> None:
        for _ in range(n):
            room.parse(body, {})

    return run


def queue_hop(mode: str) -> float:
    """µs per item handed from a producer task to a consumer, as the relay does per chunk."""

    async def main() -> float:
        q: asyncio.Queue[int | None] = asyncio.Queue(maxsize=64)

        async def producer() -> None:
            for i in range(N):
                await q.put(i)
                await asyncio.sleep(0)  # the consumer finds the queue empty each time, as with paced chunks
            await q.put(None)

        task = asyncio.create_task(producer())
        start = time.process_time()
        while True:
            if mode == "wait_for":
                item = await asyncio.wait_for(q.get(), 5.0)
            elif mode == "timeout":
                async with asyncio.timeout(5.0):
                    item = await q.get()
            else:
                item = await q.get()
            if item is None:
                break
        await task
        return (time.process_time() - start) / N * 1e6

    async def direct() -> float:
        async def gen():  # type: ignore[no-untyped-def]
            for i in range(N):
                yield i
                await asyncio.sleep(0)

        start = time.process_time()
        async for _ in gen():
            pass
        return (time.process_time() - start) / N * 1e6

    return asyncio.run(direct() if mode == "direct" else main())


def generator_layers(layers: int) -> float:
    """µs per item through ``layers`` nested async generators (httpx-sse stacks four)."""

    async def source():  # type: ignore[no-untyped-def]
        for i in range(N):
            yield i

    async def wrap(inner):  # type: ignore[no-untyped-def]
        async for x in inner:
            yield x

    async def main() -> float:
        it = source()
        for _ in range(layers - 1):
            it = wrap(it)
        start = time.process_time()
        async for _ in it:
            pass
        return (time.process_time() - start) / N * 1e6

    return asyncio.run(main())


def import_rss_mib(code: str) -> float:
    """VmRSS after running ``code`` in a fresh interpreter (MiB)."""
    probe = code + "\nprint([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024


STUB_BPE = "import sys, types; sys.modules['bpe_openai'] = types.ModuleType('bpe_openai')\n"


def run_all() -> dict[str, Any]:
    from gateway.protocols.tokens import count_text

    text_2k = ("Hello from the codebuddy2api simulator. " * 60)[:2048]
    out: dict[str, Any] = {
        "per_chunk_us": {
            "httpx-sse decode (str + lines + event; used before 12-01)": per_call_us(sse_httpx_sse),
            "gateway/upstream/sse.py SSEDataParser.feed (bytes, what the gateway uses)": per_call_us(sse_gateway_parser),
            "orjson.loads of one frame": per_call_us(json_loads),
            **{f"accumulator + scheduler + {p} encoder (incl. loads)": per_call_us(pipeline(p), 5000)
               for p in ("chat", "messages", "responses")},
        },
        "queue_hop_us": {mode: queue_hop(mode) for mode in ("wait_for", "timeout", "plain", "direct")},
        "generator_layers_us": {str(n): generator_layers(n) for n in (1, 2, 4, 5)},
        "per_request_us": {
            "chat parse": per_call_us(parse_request("chat"), 3000),
            "messages parse (incl. o200k input-token count)": per_call_us(parse_request("messages"), 3000),
            "count_text of a 2 KB answer (o200k)": per_call_us(lambda n: [count_text(text_2k) for _ in range(n)], 500),
        },
        "rss_mib": {
            "python alone": import_rss_mib("pass"),
            "import bpe_openai": import_rss_mib("import bpe_openai"),
            "bpe_openai + o200k tables loaded": import_rss_mib(
                "import bpe_openai; bpe_openai.get_encoding('o200k_base').encode_ordinary('hi')"),
            "import gateway.app": import_rss_mib("import gateway.app"),
            "import gateway.app with bpe_openai stubbed out": import_rss_mib(STUB_BPE + "import gateway.app"),
            "import gateway.app, o200k loaded": import_rss_mib(
                "import gateway.app\nfrom gateway.protocols.tokens import count_text; count_text('hi')"),
        },
    }
    return out


if __name__ == "__main__":
    print(json.dumps(run_all(), indent=1))
