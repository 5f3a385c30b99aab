"""Turn py-spy's raw (collapsed-stack) output into a flame summary: top functions by self
and by total samples, and self samples grouped by library (where the CPU actually goes)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

_LINE = re.compile(r":\d+\)$")

#: File-path fragments -> the area a frame belongs to (first match wins).
AREAS = (
    ("gateway/stream/", "gateway.stream"), ("gateway/protocols/", "gateway.protocols"),
    ("gateway/upstream/", "gateway.upstream"), ("gateway/observability/", "gateway.observability"),
    ("gateway/store/", "gateway.store"), ("gateway/", "gateway (other)"),
    ("httpx_sse", "httpx-sse"), ("httpx", "httpx"), ("httpcore", "httpcore"), ("h11", "h11"),
    ("uvicorn", "uvicorn"), ("starlette", "starlette"), ("anyio", "anyio"), ("asyncio", "asyncio"),
    ("structlog", "structlog"), ("prometheus_client", "prometheus_client"), ("sqlite3", "sqlite3"),
    ("selectors", "asyncio"), ("socket", "socket"), ("ssl", "ssl"), ("json", "json"),
)


#: Leaf frames that are a thread waiting, not working (py-spy --nonblocking cannot always tell).
IDLE_LEAVES = frozenset({
    "EpollSelector.select (selectors.py)", "select (selectors.py)",
    "_worker (concurrent/futures/thread.py)", "wait (threading.py)", "Condition.wait (threading.py)",
})


def frame_key(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (path/file.py)``: lines of one function merge."""
    return _LINE.sub(")", frame.strip())


#: With uvloop the loop, its callbacks' socket I/O and its scheduling run in C under this frame.
UVLOOP_LEAF = "Runner.run (asyncio/runners.py)"


def area(frame: str) -> str:
    if frame == UVLOOP_LEAF:
        return "event loop in C (uvloop: socket I/O, scheduling)"
    for fragment, name in AREAS:
        if fragment in frame:
            return name
    return "other"


def summarize_raw(text: str, top: int = 25) -> dict[str, Any]:
    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    area_c: Counter[str] = Counter()
    samples = idle = 0
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_key(f) for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        if frames[-1] in IDLE_LEAVES:
            idle += n
            continue
        samples += n
        self_c[frames[-1]] += n
        area_c[area(frames[-1])] += n
        for f in set(frames):
            total_c[f] += n

    def rows(counter: Counter[str]) -> list[dict[str, Any]]:
        return [{"function": f, "samples": c, "pct": round(100 * c / samples, 1) if samples else 0.0}
                for f, c in counter.most_common(top)]

    roots = ("(gateway/__main__.py)", "main (gateway/cli.py)", "serve (gateway/cli.py)")
    ours = Counter({f: c for f, c in total_c.items() if "gateway/" in f and not f.endswith(roots)})
    return {"samples": samples, "idle_samples": idle, "top_self": rows(self_c), "top_total": rows(total_c),
            "top_gateway_total": rows(ours), "by_area": rows(area_c)}
