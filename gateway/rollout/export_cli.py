"""``codebuddy2api capture export``: one rollout's call records, in order, as JSONL.

The store is where every capture mode records a rollout's calls, so it is the default
source: the SQLite file of ``--data-dir`` (or the settings' data dir) or ``--database-url``.
The store is opened as it is, never created nor migrated: a missing SQLite file is one
line and exit status 2, an unknown rollout one line and exit status 1, so a script run
from the wrong folder fails instead of exporting nothing. ``--capture-dir DIR`` reads the
JSONL capture files instead (the per-request log of ``--capture-dir``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

#: Exit statuses: a store or directory that is not there (2), a rollout it does not hold (1).
MISSING_SOURCE, UNKNOWN_ROLLOUT = 2, 1


def _fail(status: int, message: str) -> int:
    print(f"codebuddy2api: error: {message}", file=sys.stderr)
    return status


def export_capture(rollout: str, capture_dir: str | None, data_dir: str | None = None,
                   database_url: str | None = None) -> int:
    """Write the rollout's records to stdout; the exit status."""
    from gateway.rollout.ids import VALID

    if not VALID.fullmatch(rollout):
        return _fail(MISSING_SOURCE, f"invalid rollout id {rollout[:40]!r}: 1-128 of A-Z a-z 0-9 . _ : -")
    if capture_dir:
        return _from_files(rollout, Path(capture_dir))
    return _from_store(rollout, data_dir, database_url)


def _from_files(rollout: str, directory: Path) -> int:
    from gateway.rollout.capture_files import export_rollout

    if not directory.is_dir():
        return _fail(MISSING_SOURCE, f"--capture-dir {directory} is not a directory")
    records = export_rollout(directory, rollout)
    if not records:
        return _fail(UNKNOWN_ROLLOUT, f"no records of rollout {rollout!r} in {directory}")
    _write(records)
    return 0


def _from_store(rollout: str, data_dir: str | None, database_url: str | None) -> int:
    from gateway.rollout.store import export_records
    from gateway.store.db import StoreMissing, open_existing_database

    if data_dir is None and database_url is None:
        from gateway.settings import load_settings

        settings = load_settings()[0]
        data_dir = str(settings.data_dir)
        database_url = settings.database_url.get_secret_value() if settings.database_url is not None else None
    try:
        db = open_existing_database(database_url, Path(data_dir or "data"))
    except StoreMissing as exc:
        return _fail(MISSING_SOURCE, str(exc))
    except Exception as exc:  # noqa: BLE001  (a bad URL or an unreachable server: one line, no secret)
        return _fail(MISSING_SOURCE, f"cannot open the store: {type(exc).__name__}")
    try:
        try:
            records = export_records(db, rollout)
        except db.errors as exc:  # a store from before rollouts (no rollout_calls table)
            return _fail(MISSING_SOURCE, f"cannot read rollouts from the store: {type(exc).__name__}")
    finally:
        db.close()
    if not records:
        return _fail(UNKNOWN_ROLLOUT, f"no rollout {rollout!r} in the store")
    _write(records)
    return 0


def _write(records: list[dict[str, Any]]) -> None:
    out = sys.stdout.buffer
    for record in records:
        out.write(orjson.dumps(record) + b"\n")
    out.flush()
