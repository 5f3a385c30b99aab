"""The bulk export as Parquet (``format=parquet``, docs/capture.md "Parquet"): for every
shape the file read back with pyarrow holds the JSONL export's records, one row each, for
the same filters and cursor; an empty export keeps its shape's columns; the client helper
downloads it; a server without pyarrow answers a 400 and keeps its JSONL export."""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codebuddy2api.client import Rollouts, RolloutsError
from gateway.rollout import parquet_export
from gateway.rollout.parquet_export import NATIVE_JSON
from tests.conftest import Gateway
from tests.rollout.test_trainer_export import (  # noqa: F401 (module fixtures)
    bulk,
    client_for,
    new_rollout,
    post,
    scored_rollout,
    trainer_gateway,
)

SHAPES = ("native", "nemo-gym", "trl", "verifiers")


def parquet(gateway: Gateway, **params: str) -> pa.Table:
    response = httpx.get(gateway.url + "/admin/api/rollouts/export", params={**params, "format": "parquet"},
                         headers=gateway.admin, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/vnd.apache.parquet"
    shape = params.get("shape", "native")
    assert response.headers["content-disposition"] == f'attachment; filename="rollouts-{shape}.parquet"'
    return pq.read_table(io.BytesIO(response.content))


def as_records(shape: str, table: pa.Table) -> list[dict[str, Any]]:
    """The rows as the JSONL records they stand for: native's JSON text columns parsed,
    a trainer shape's ``call_rewards`` MAP (pairs) as the dict it is."""
    rows = table.to_pylist()
    for row in rows:
        if shape == "native":
            row.update({k: None if row[k] is None else json.loads(row[k]) for k in NATIVE_JSON})
        else:
            row["call_rewards"] = dict(row["call_rewards"])
    return rows


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_as_parquet_holds_the_jsonl_records(trainer_gateway: Gateway, scored_rollout: dict[str, Any], shape: str) -> None:
    lines = bulk(trainer_gateway, group=scored_rollout["group"], shape=shape)
    table = parquet(trainer_gateway, group=scored_rollout["group"], shape=shape)
    assert table.column_names == list(lines[0])  # the JSONL line's keys, in its order
    assert as_records(shape, table) == lines
    ids = scored_rollout["call_ids"]
    if shape == "native":
        [line] = lines
        assert [s["call_ids"] for s in line["segments"]] == [ids[:2], ids[2:]] and len(line["calls"]) == 3
        assert line["reward"]["reward"] == 0.75 and line["group_id"] == scored_rollout["group"]
    else:
        assert [line["call_ids"] for line in lines] == [ids[:2], ids[2:]]  # the edit: two segments, two rows
        assert lines[0]["call_rewards"] == {ids[1]: -1.0}
        assert table.schema.field("call_rewards").type == pa.map_(pa.string(), pa.float64())
        reward = "env_reward" if shape == "trl" else "reward"
        assert table.column(reward).to_pylist() == [0.75, 0.75]
    if shape == "nemo-gym":  # a Parquet nested type, not text
        assert pa.types.is_struct(table.schema.field("output").type.value_type)
        assert table.to_pylist()[0]["output"][1]["generation_token_ids"] == lines[0]["output"][1]["generation_token_ids"]
    if shape in ("trl", "verifiers"):
        assert table.schema.field("prompt_ids").type == pa.list_(pa.int64())


def test_parquet_honours_the_filters_and_the_cursor_with_a_row_group_per_page(
        trainer_gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.rollout import bulk_export

    gateway, group = trainer_gateway, "pq-page-" + secrets.token_hex(4)
    rollouts = [new_rollout(f"pqpage{n}") for n in range(5)]
    for rollout in rollouts:
        client_for(gateway, rollout, {"x-rollout-group": group}).chat.completions.create(
            model="text", messages=[{"role": "user", "content": "hi"}])
    monkeypatch.setattr(bulk_export, "PAGE_ROLLOUTS", 2)  # three pages
    response = httpx.get(gateway.url + "/admin/api/rollouts/export", headers=gateway.admin, timeout=30,
                         params={"group": group, "shape": "verifiers", "format": "parquet"})
    assert pq.ParquetFile(io.BytesIO(response.content)).metadata.num_row_groups == 3
    rows = parquet(gateway, group=group, shape="verifiers").to_pylist()
    assert [row["rollout_id"] for row in rows] == rollouts
    cursor = rows[1]["cursor"]
    assert [row["rollout_id"] for row in parquet(gateway, group=group, shape="verifiers", cursor=cursor).to_pylist()] == rollouts[2:]
    updated = [line["updated_at"] for line in bulk(gateway, group=group)]
    window = parquet(gateway, group=group, since=repr(updated[1]), until=repr(updated[3]))
    assert window.column("rollout_id").to_pylist() == rollouts[1:3]
    for rollout in rollouts[:2]:
        assert post(gateway, rollout, "freeze", {}).status_code == 200
    for frozen, expected in (("true", rollouts[:2]), ("false", rollouts[2:])):
        table = parquet(gateway, group=group, frozen=frozen, shape="trl")
        assert as_records("trl", table) == bulk(gateway, group=group, frozen=frozen, shape="trl")
        assert table.column("rollout_id").to_pylist() == expected


@pytest.mark.parametrize("shape", SHAPES)
def test_an_empty_parquet_export_has_the_shapes_columns_and_no_rows(trainer_gateway: Gateway, shape: str) -> None:
    table = parquet(trainer_gateway, group="no-such-group-" + secrets.token_hex(4), shape=shape)
    assert table.num_rows == 0
    assert table.schema == parquet_export.schema(pa, shape)
    assert "cursor" in table.column_names and "rollout_id" in table.column_names


def test_the_client_downloads_parquet_to_a_file(trainer_gateway: Gateway, scored_rollout: dict[str, Any], tmp_path: Path) -> None:
    gateway = trainer_gateway
    with Rollouts(gateway.url, gateway.app.state.admin_access.token) as rollouts:
        path = rollouts.export_parquet(tmp_path / "step7.parquet", group=scored_rollout["group"], shape="trl")
        assert path == tmp_path / "step7.parquet"
        assert as_records("trl", pq.read_table(path)) == list(rollouts.export(group=scored_rollout["group"], shape="trl"))
        with pytest.raises(RolloutsError) as bad:
            rollouts.export_parquet(tmp_path / "bad.parquet", group="a b")
        assert (bad.value.status, bad.value.code) == (400, "invalid_parameter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step7.parquet"]  # no partial file left


def test_without_pyarrow_parquet_is_a_400_and_jsonl_still_works(
        trainer_gateway: Gateway, scored_rollout: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gateway = trainer_gateway
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` now raises ImportError
    response = httpx.get(gateway.url + "/admin/api/rollouts/export", headers=gateway.admin,
                         params={"format": "parquet", "group": scored_rollout["group"]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "parquet_unavailable", "format")
    assert "pip install 'codebuddy2api[parquet]'" in error["message"]
    assert [line["rollout_id"] for line in bulk(gateway, group=scored_rollout["group"])] == [scored_rollout["rollout"]]
    with Rollouts(gateway.url, gateway.app.state.admin_access.token) as rollouts, pytest.raises(RolloutsError) as refused:
        rollouts.export_parquet(tmp_path / "x.parquet")
    assert (refused.value.status, refused.value.code) == (400, "parquet_unavailable")
    assert list(tmp_path.iterdir()) == []


def test_the_base_install_does_not_import_pyarrow() -> None:
    script = ("import sys, gateway.app, gateway.cli, gateway.admin.rollout_export_api, codebuddy2api.client; "
              "print('pyarrow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


# -- the I/O shell over a real SQLite store (unit seams, as tests/rollout/test_bulk_export.py) --


def parquet_peak_while_exporting(tmp_path: Path, rollouts: int) -> tuple[int, int]:
    """Python's peak (tracemalloc, every thread) and Arrow's pool peak while ``rollouts``
    rollouts are written as Parquet and the file read back in chunks."""
    import asyncio
    import tracemalloc

    from gateway.rollout.bulk_export import BulkExport, ExportQuery
    from gateway.store.db import Database
    from tests.rollout.test_bulk_export import StoreReader, fill

    db = Database(tmp_path / f"pq-{rollouts}.sqlite3")
    fill(db, rollouts)

    async def consume() -> int:
        bulk = BulkExport(StoreReader(db), ExportQuery(shape="verifiers"))
        await bulk.first_page()
        out = await parquet_export.build(bulk)
        assert out.rows == rollouts
        return sum([len(chunk) async for chunk in parquet_export.chunks(out)])

    tracemalloc.start()
    try:
        assert asyncio.run(consume()) > 0
        return tracemalloc.get_traced_memory()[1], pa.default_memory_pool().max_memory()
    finally:
        tracemalloc.stop()
        db.close()


def _parquet_peak_in_a_process_of_its_own(tmp_path: Path, rollouts: int) -> tuple[int, int]:
    script = ("import sys; from pathlib import Path; from gateway.rollout import bulk_export, parquet_export; "
              "from tests.rollout.test_parquet_export import parquet_peak_while_exporting; "
              "bulk_export.PAGE_ROLLOUTS = 25; parquet_export.SPOOL_BYTES = 64 * 1024; "
              "print(*parquet_peak_while_exporting(Path(sys.argv[1]), int(sys.argv[2])))")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(rollouts)], check=True,
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    python, arrow = out.stdout.split()[-2:]
    return int(python), int(arrow)


def test_parquet_memory_does_not_grow_with_the_rollouts_exported(tmp_path: Path) -> None:
    """With the spool past its (here small) size on disk, neither Python's nor Arrow's peak
    grows with the rollouts: a page of rows at a time."""
    small, large = _parquet_peak_in_a_process_of_its_own(tmp_path, 50), _parquet_peak_in_a_process_of_its_own(tmp_path, 300)
    # holding every rollout would take ~6x the small peak. Python's peak varies with the threads'
    # timing (a loaded run saw 298 KB small, 473 KB large: the next page read while the last is
    # written, or not), so its bound is 2.5x, as the JSONL export's; Arrow's pool does not vary.
    assert large[0] < small[0] * 2.5 and large[1] < small[1] * 1.5, (small, large)


def test_a_store_failure_mid_way_fails_the_parquet_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer has not begun (a Parquet file is whole or nothing): the failure raises
    for the route's 503, and the half-written file is dropped."""
    import asyncio
    import sqlite3

    from gateway.rollout import bulk_export
    from gateway.rollout.bulk_export import BulkExport, ExportQuery
    from gateway.store.db import Database
    from tests.rollout.test_bulk_export import StoreReader, fill

    monkeypatch.setattr(bulk_export, "PAGE_ROLLOUTS", 2)
    files: list[parquet_export.ParquetFile] = []
    real = parquet_export.ParquetFile

    def keep(shape: str) -> parquet_export.ParquetFile:
        files.append(real(shape))
        return files[-1]

    monkeypatch.setattr(parquet_export, "ParquetFile", keep)
    db = Database(tmp_path / "store.sqlite3")
    fill(db, 5, tokens=4)

    async def run(reader: StoreReader) -> parquet_export.ParquetFile:
        bulk = BulkExport(reader, ExportQuery(shape="trl"))
        await bulk.first_page()
        return await parquet_export.build(bulk)

    with pytest.raises(sqlite3.OperationalError):
        asyncio.run(run(StoreReader(db, fail_at="r.00003")))
    assert files[0].rows == 2 and files[0].file.closed  # the first page written, then dropped
    whole = asyncio.run(run(StoreReader(db)))
    assert pq.read_table(io.BytesIO(whole.file.read())).column("rollout_id").to_pylist() == [f"r.{n:05d}" for n in range(5)]
    whole.close()
    db.close()
