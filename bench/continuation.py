"""What transparent continuation (issue #35, gateway/engines/continuation.py) costs every
chat answer, in CPU, no servers: a 200-chunk answer read straight from a fake send against
the same answer through ``continuing`` (the wrapper every chat attempt now goes through),
and an answer aborted halfway and continued (the second leg from the same fake send).

``python bench/continuation.py`` prints one JSON object (µs CPU per answer and per chunk).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.engines.continuation import continuing  # noqa: E402
from gateway.stream.answer import DONE  # noqa: E402
from gateway.upstream.client import ANSWERED  # noqa: E402

CHUNKS = 200
ROUNDS = 300


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def _answer(abort_at: int | None) -> list[Any]:
    items: list[Any] = [ANSWERED]
    for n in range(CHUNKS):
        items.append(_chunk("word ", "abort" if n == abort_at else ("stop" if n == CHUNKS - 1 else None)))
        if n == abort_at:
            break
    items.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 50, "total_tokens": 55}})
    return [*items, DONE]


def _fake_send(legs: list[list[Any]]) -> Any:
    async def send(credential: Any, body: Any, policy: Any, headers: Any = None) -> AsyncIterator[Any]:
        for item in legs.pop(0):
            yield item

    return send


async def _ready(credential: Any, policy: Any) -> None:
    return None


async def _drain(items: AsyncIterator[Any]) -> int:
    count = 0
    async for _ in items:
        count += 1
    return count


async def _cpu_us(make: Any) -> float:
    start = time.process_time()
    for _ in range(ROUNDS):
        await _drain(make())
    return (time.process_time() - start) / ROUNDS * 1e6


async def main() -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    whole = _answer(None)
    direct = await _cpu_us(lambda: _fake_send([list(whole)])(None, body, None))
    wrapped = await _cpu_us(lambda: continuing(_fake_send([list(whole)]), _ready)(None, body, None))  # type: ignore[arg-type]
    halves = [_answer(CHUNKS // 2), _answer(None)[: CHUNKS // 2 + 1] + _answer(None)[-3:]]
    continued = await _cpu_us(lambda: continuing(_fake_send([list(h) for h in halves]), _ready)(None, body, None))  # type: ignore[arg-type]
    return {
        "chunks_per_answer": CHUNKS,
        "direct_us_per_answer": round(direct, 1),
        "through_continuing_us_per_answer": round(wrapped, 1),
        "added_us_per_chunk": round((wrapped - direct) / CHUNKS, 2),
        "aborted_halfway_and_continued_us_per_answer": round(continued, 1),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
