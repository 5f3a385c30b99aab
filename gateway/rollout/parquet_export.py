"""The bulk export as one Parquet file (``format=parquet``, docs/capture.md "Parquet").

The same records the JSONL export yields for a shape and its filters, one row each, under
a schema fixed per shape (so every page writes the same columns and an empty export still
has them). Each rollout's records become Arrow columns in the worker thread that renders
them; a page of rollouts (:data:`gateway.rollout.bulk_export.PAGE_ROLLOUTS`) is one row
group, written by :class:`pyarrow.parquet.ParquetWriter` in a worker thread into a
spooled temporary file (memory up to :data:`SPOOL_BYTES`, then disk); the answer streams
that file once it is whole (a Parquet file's footer comes last). Nothing holds more than
one page of rows in Arrow's memory and one rollout's records as Python objects.

pyarrow is an optional extra (``pip install 'codebuddy2api[parquet]'``): it is imported
only here, only when such an export is asked for.
"""

from __future__ import annotations

import asyncio
import importlib
import tempfile
from collections.abc import AsyncIterator
from typing import IO, Any

import orjson

from gateway.rollout.bulk_export import BulkExport

#: Bytes of the file kept in memory before the spool moves to disk.
SPOOL_BYTES = 8 * 1024 * 1024
#: Bytes per chunk of the answer.
CHUNK_BYTES = 256 * 1024
INSTALL_HINT = "pip install 'codebuddy2api[parquet]'"
#: ``native``'s free-form values (upstream bodies, reward details, segments with whatever
#: the engine added): JSON text columns, as in the JSONL line.
NATIVE_JSON = ("reward", "call_rewards", "calls", "segments")


class ParquetUnavailable(RuntimeError):
    """pyarrow is not installed."""


def load_pyarrow() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``, imported on first use (the base install has neither)."""
    try:
        return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ParquetUnavailable(f"format=parquet needs pyarrow: {INSTALL_HINT}") from None


def schema(pa: Any, shape: str) -> Any:
    """The columns of ``shape``'s rows, in the JSONL line's order."""
    ids, floats, mask = pa.list_(pa.int64()), pa.list_(pa.float64()), pa.list_(pa.int8())
    common = [("rollout_id", pa.string()), ("group_id", pa.string()), ("complete", pa.bool_()), ("frozen", pa.bool_())]
    if shape == "native":
        fields = [*common, ("incomplete", pa.list_(pa.string())), ("undelivered", pa.list_(pa.string())),
                  ("forked", pa.bool_()),
                  ("forks", pa.list_(pa.struct([("call_id", pa.string()), ("extends", pa.string())]))),
                  ("updated_at", pa.float64()), ("reward", pa.large_string()), ("call_rewards", pa.large_string()),
                  ("calls", pa.large_string()), ("segments", pa.large_string())]
    else:
        fields = [*common, ("segment", pa.int64()), ("segment_count", pa.int64()), ("call_ids", pa.list_(pa.string())),
                  ("call_rewards", pa.map_(pa.string(), pa.float64()))]
        version = [("version", pa.string()), ("from_token", pa.int64())]  # docs/weight-sync.md
        if shape == "nemo-gym":
            entry = pa.struct([("call_id", pa.string()), ("prompt_token_ids", ids), ("generation_token_ids", ids),
                               ("generation_log_probs", floats), ("weight_versions", pa.list_(pa.struct(version)))])
            fields += [("output", pa.list_(entry)), ("reward", pa.float64())]
        elif shape == "trl":
            fields += [("prompt_ids", ids), ("completion_ids", ids), ("logprobs", floats), ("env_mask", mask),
                       ("env_reward", pa.float64())]
        else:  # verifiers
            fields += [("prompt_ids", ids), ("completion_ids", ids), ("completion_mask", mask),
                       ("completion_logprobs", floats), ("reward", pa.float64())]
        if shape != "nemo-gym":
            fields.append(("weight_versions", pa.list_(pa.struct([("call_id", pa.string()), *version]))))
    return pa.schema([*fields, ("cursor", pa.string())])


def to_row(shape: str, record: dict[str, Any]) -> dict[str, Any]:
    """A JSONL record as its row: ``native``'s free-form values as JSON text (None stays
    null); a trainer shape's ``call_rewards`` as the MAP's (key, value) pairs."""
    if shape == "native":
        return {**record, **{k: None if record[k] is None else orjson.dumps(record[k]).decode() for k in NATIVE_JSON}}
    return {**record, "call_rewards": list(record["call_rewards"].items())}


class ParquetFile:
    """The blocking half: a ParquetWriter over a spooled temporary file (each method is
    called in a worker thread)."""

    def __init__(self, shape: str) -> None:
        self.pa, pq = load_pyarrow()
        self.shape = shape
        self.schema = schema(self.pa, shape)
        self.file: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 (closed by close())
        self.writer = pq.ParquetWriter(self.file, self.schema, compression="zstd")
        self.rows = 0
        self.finished = False

    def table(self, records: list[dict[str, Any]]) -> Any:
        """One rollout's records as Arrow columns (a few bytes a token, not a Python object each)."""
        return self.pa.Table.from_pylist([to_row(self.shape, r) for r in records], schema=self.schema)

    def write_page(self, tables: list[Any]) -> None:
        """A page's rollouts as one row group (nothing for a page without records)."""
        table = self.pa.concat_tables(tables) if tables else None
        if table is not None and table.num_rows:
            self.writer.write_table(table, row_group_size=table.num_rows)
            self.rows += table.num_rows

    def finish(self) -> None:
        self.writer.close()
        self.file.seek(0)
        self.finished = True

    def read(self) -> bytes:
        return self.file.read(CHUNK_BYTES)

    def close(self) -> None:
        if not self.finished:  # given up half-way: end the writer before its file goes
            self.finished = True
            self.writer.close()
        self.file.close()


async def build(bulk: BulkExport) -> ParquetFile:
    """The whole export written to its spooled file; a store failure on the way raises
    (the answer has not begun: the route turns it into a 503) and drops the file."""
    out = await asyncio.to_thread(ParquetFile, bulk.query.shape)
    try:
        async for tables in bulk.record_pages(out.table):
            await asyncio.to_thread(out.write_page, tables)
        await asyncio.to_thread(out.finish)
    except BaseException:
        await asyncio.to_thread(out.close)
        raise
    return out


async def chunks(out: ParquetFile) -> AsyncIterator[bytes]:
    """The finished file, read in a worker thread a chunk at a time, then closed."""
    try:
        while chunk := await asyncio.to_thread(out.read):
            yield chunk
    finally:
        await asyncio.to_thread(out.close)
