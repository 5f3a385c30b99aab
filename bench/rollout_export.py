"""The bulk rollout export (``GET /admin/api/rollouts/export``, issue #37) over a real
SQLite store of N synthetic rollouts (3 chained calls each, ~600 tokens per call): how
many rollouts per second it streams (untraced) and the peak Python memory (tracemalloc,
every thread) of a second pass, for N = 200 and 1,000: constant memory means the peak does not
grow with N (it holds one page of ids and one rollout's records).

``--format parquet``: the same export as one Parquet file (``format=parquet``,
gateway/rollout/parquet_export.py; pyarrow needed): seconds until the file is whole and
read back in chunks, its size, the peak traced Python memory and Arrow's memory pool's peak
(pyarrow allocates outside tracemalloc's sight); the spool keeps up to 8 MiB of the file in
memory, then moves it to disk.

``python bench/rollout_export.py [--shape native|nemo-gym|trl|verifiers] [--format jsonl|parquet]``
prints one JSON object; ``bench/run.py`` (``make bench``) adds the JSONL one to its results
as ``rollout_export``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from gateway.rollout import store as rollout_store  # noqa: E402
from gateway.rollout.bulk_export import BulkExport, ExportQuery  # noqa: E402
from gateway.store.db import Database, Store  # noqa: E402


def fill(db: Store, rollouts: int, calls: int = 3, tokens: int = 200) -> None:
    """``rollouts`` rollouts of ``calls`` chained calls (each prompt = the previous prompt +
    completion + 10 environment tokens), written as the recorder writes them."""
    rows = []
    for r in range(rollouts):
        prompt = list(range(tokens))
        for c in range(calls):
            completion = [1000 + c * tokens + k for k in range(tokens)]
            record = {"call_id": f"req_{r:05d}_{c}", "rollout_id": f"bench.{r:05d}", "started_at": 1000.0 + r + c / 10,
                      "ended_at": 1000.05 + r + c / 10, "outcome": "success", "protocol": "chat",
                      "answer": {"text": "x" * 200}, "upstream_request": {"messages": [{"role": "user", "content": "y" * 400}]},
                      "tokens": {"prompt_ids": prompt, "completion_ids": completion,
                                 "completion_logprobs": [-0.5] * len(completion)}}
            rows.append(rollout_store.call_row(record, orjson.dumps(record)))
            prompt = prompt + completion + list(range(50_000, 50_010))
    db.run_tx(lambda conn: conn.executemany(rollout_store.CALL_UPSERT, rows))


class StoreReader:
    """What the export reads through: the store's records and marks of a rollout."""

    def __init__(self, db: Store) -> None:
        self.db = db

    async def read(self, rollout_id: str) -> tuple[list[dict[str, Any]], list[Any]] | None:
        def run(conn: Any) -> tuple[list[dict[str, Any]], list[Any]]:
            return rollout_store.load_calls(conn, rollout_id), rollout_store.load_marks(conn, rollout_id)

        records, marks = await self.db.arun(run)
        return (records, marks) if records or marks else None


async def stream(db: Store, shape: str) -> tuple[int, int]:
    """Lines and bytes of a whole export."""
    bulk = BulkExport(StoreReader(db), ExportQuery(shape=shape))
    await bulk.first_page()
    lines = size = 0
    async for chunk in bulk.lines():
        lines += chunk.count(b"\n")
        size += len(chunk)
    return lines, size


async def stream_parquet(db: Store, shape: str) -> tuple[int, int]:
    """Rows and bytes of a whole export as Parquet (built, then read in chunks)."""
    from gateway.rollout import parquet_export

    bulk = BulkExport(StoreReader(db), ExportQuery(shape=shape))
    await bulk.first_page()
    out = await parquet_export.build(bulk)
    rows, size = out.rows, 0
    async for chunk in parquet_export.chunks(out):
        size += len(chunk)
    return rows, size


def measure(rollouts: int, shape: str, fmt: str = "jsonl") -> dict[str, Any]:
    run = stream_parquet if fmt == "parquet" else stream
    with tempfile.TemporaryDirectory() as tmp:
        db = Database(Path(tmp) / "bench.sqlite3")
        fill(db, rollouts)
        start = time.perf_counter()
        lines, size = asyncio.run(run(db, shape))
        seconds = time.perf_counter() - start
        tracemalloc.start()  # a second pass, traced (tracing slows it several times)
        asyncio.run(run(db, shape))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        db.close()
    result = {"rollouts": rollouts, "lines": lines, "mib_streamed": round(size / 2**20, 1),
              "seconds": round(seconds, 2), "rollouts_per_s": round(rollouts / seconds),
              "peak_traced_mib": round(peak / 2**20, 2)}
    if fmt == "parquet":
        import pyarrow

        result["arrow_pool_peak_mib"] = round(pyarrow.default_memory_pool().max_memory() / 2**20, 2)
    return result


def run_all(shapes: tuple[str, ...] = ("native", "nemo-gym", "trl", "verifiers"), fmt: str = "jsonl") -> dict[str, Any]:
    """Every shape at 200 and 1,000 rollouts (``bench/run.py`` adds it as ``rollout_export``)."""
    return {shape: [measure(n, shape, fmt) for n in (200, 1000)] for shape in shapes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default=None, help="one shape [default: all four]")
    parser.add_argument("--format", default="jsonl", choices=("jsonl", "parquet"))
    args = parser.parse_args()
    shapes = (args.shape,) if args.shape else ("native", "nemo-gym", "trl", "verifiers")
    print(json.dumps(run_all(shapes, args.format)))


if __name__ == "__main__":
    main()
