"""Reads of the audit table: the filtered list, one record, the window summary, the
per-credential stats and the JSON-lines export.

Apart from :mod:`gateway.store.audit` (the write side: queue, batch writer, overflow,
retention) so each module stays small; this one only reads rows that one writes, and
neither imports the other.
"""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.store.db import Store

#: Columns the audit list filters on, exactly; ``transport`` is generated from the record
#: (migration 7), so ``AUDIT_UPSERT`` (gateway/store/audit.py) never names it.
FILTER_COLUMNS = ("outcome", "protocol", "mode", "model", "error_code", "request_id", "transport")


def upstream_pattern(name: str, field: str = "upstream") -> str:
    """A LIKE pattern for ``"upstream":"<name>"`` (or another ``field``) in a record
    (orjson writes it compact): the name JSON-escaped, then LIKE's own wildcards escaped with ``!``."""
    literal = f'"{field}":' + orjson.dumps(name).decode()
    return "%" + literal.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"


def _where(since: float | None, until: float | None, filters: dict[str, str | None]) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    if since is not None:
        clauses.append("started_at >= ?")
        params.append(since)
    if until is not None:
        clauses.append("started_at < ?")
        params.append(until)
    for column in FILTER_COLUMNS:
        value = filters.get(column)
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    upstream = filters.get("upstream")
    if upstream is not None:  # no column (no migration): any attempt's upstream, read in the record's JSON
        clauses.append("record LIKE ? ESCAPE '!'")
        params.append(upstream_pattern(upstream))
    key_id = filters.get("key_id")
    if key_id is not None:  # the managed client key (gateway/keys/), read in the record's JSON
        clauses.append("record LIKE ? ESCAPE '!'")
        params.append(upstream_pattern(key_id, "key_id"))
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


async def query(
    db: Store,
    *,
    since: float | None = None,
    until: float | None = None,
    limit: int = 100,
    offset: int = 0,
    **filters: str | None,
) -> tuple[list[dict[str, Any]], int]:
    """Matching records, newest first, and the total number matching."""
    where, params = _where(since, until, filters)

    def run(conn: Any) -> tuple[list[dict[str, Any]], int]:
        total = conn.execute(f"SELECT COUNT(*) FROM audit{where}", params).fetchone()[0]
        rows = conn.execute(
            f"SELECT record FROM audit{where} ORDER BY started_at DESC, request_id DESC LIMIT ? OFFSET ?",
            [*params, limit, offset],
        ).fetchall()
        return [orjson.loads(r[0]) for r in rows], int(total)

    return await db.arun(run)


async def get(db: Store, request_id: str) -> dict[str, Any] | None:
    rows = await db.aexecute("SELECT record FROM audit WHERE request_id = ?", (request_id,))
    return orjson.loads(rows[0][0]) if rows else None


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n * q / 100)
    return sorted_values[int(rank) - 1]


async def aggregate(db: Store, window: float, now: float | None = None) -> dict[str, Any]:
    """Counts by outcome, error rate and p50/p95 TTFB by protocol and mode over the window."""
    until = time.time() if now is None else now
    since = until - window

    def run(conn: Any) -> list[tuple[Any, ...]]:
        return conn.execute(
            "SELECT protocol, mode, outcome, json_extract(record, '$.ttfb_ms'),"
            " json_extract(record, '$.duration_ms') FROM audit WHERE started_at >= ? AND started_at < ?",
            (since, until),
        ).fetchall()

    rows = await db.arun(run)
    by_outcome: collections.Counter[str] = collections.Counter()
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for protocol, mode, outcome, ttfb, duration in rows:
        by_outcome[outcome] += 1
        group = groups.setdefault((protocol, mode), {"count": 0, "errors": 0, "ttfb": [], "duration": []})
        group["count"] += 1
        group["errors"] += outcome == "error"
        if ttfb is not None:
            group["ttfb"].append(float(ttfb))
        if duration is not None:
            group["duration"].append(float(duration))
    total = len(rows)
    series = []
    for (protocol, mode), group in sorted(groups.items()):
        ttfb_sorted, duration_sorted = sorted(group["ttfb"]), sorted(group["duration"])
        series.append({
            "protocol": protocol,
            "mode": mode,
            "requests": group["count"],
            "error_rate": group["errors"] / group["count"],
            "ttfb_samples": len(ttfb_sorted),
            "ttfb_ms_p50": percentile(ttfb_sorted, 50),
            "ttfb_ms_p95": percentile(ttfb_sorted, 95),
            "duration_ms_p50": percentile(duration_sorted, 50),
            "duration_ms_p95": percentile(duration_sorted, 95),
        })
    return {
        "window": window,
        "since": since,
        "until": until,
        "requests": total,
        "by_outcome": dict(sorted(by_outcome.items())),
        "error_rate": (by_outcome["error"] / total) if total else 0.0,
        "by_protocol_mode": series,
    }


async def credential_stats(db: Store, since: float) -> dict[str, dict[str, Any]]:
    """Per credential fingerprint since ``since``: upstream attempts, how many succeeded
    (answered 200 without an error) or failed, the success rate and the last error."""

    def run(conn: Any) -> list[tuple[Any, ...]]:  # SQL that runs on SQLite and PostgreSQL
        return conn.execute(
            "SELECT started_at, json_extract(record, '$.upstream_attempts') FROM audit"
            " WHERE started_at >= ? ORDER BY started_at",
            (since,),
        ).fetchall()

    stats: dict[str, dict[str, Any]] = {}
    for started_at, attempts in await db.arun(run):
        if isinstance(attempts, (str, bytes)):
            attempts = orjson.loads(attempts)
        for attempt in attempts or ():
            key = str(attempt.get("credential") or "")
            entry = stats.setdefault(key, {"attempts": 0, "succeeded": 0, "failed": 0, "last_error": None})
            entry["attempts"] += 1
            if attempt.get("error"):
                entry["failed"] += 1
                entry["last_error"] = {
                    "code": attempt["error"], "status": attempt.get("status"),
                    "at": float(attempt.get("started_at") or started_at),
                }
            elif attempt.get("status") == 200:
                entry["succeeded"] += 1
    for entry in stats.values():
        judged = entry["succeeded"] + entry["failed"]
        entry["success_rate"] = entry["succeeded"] / judged if judged else None
    return stats


async def export(
    db: Store, since: float | None = None, until: float | None = None, page: int = 500, **filters: str | None
) -> AsyncIterator[bytes]:
    """Every matching record (the list's filters) as JSON lines, oldest first, read a page at a time."""
    where, params = _where(since, until, filters)
    cursor: tuple[float, str] | None = None
    while True:
        clause, args = where, list(params)
        if cursor is not None:
            clause += (" AND " if clause else " WHERE ") + "(started_at > ? OR (started_at = ? AND request_id > ?))"
            args += [cursor[0], cursor[0], cursor[1]]
        rows = await db.aexecute(
            f"SELECT started_at, request_id, record FROM audit{clause} ORDER BY started_at, request_id LIMIT ?",
            [*args, page],
        )
        if not rows:
            return
        yield b"".join(r[2].encode() + b"\n" for r in rows)
        if len(rows) < page:
            return
        cursor = (rows[-1][0], rows[-1][1])


async def key_usage_rows(db: Store, key_id: str, since: float, until: float) -> list[tuple[Any, ...]]:
    """(started_at, outcome, prompt, completion, cached tokens, cost) of a managed key's
    records in ``[since, until)``, for gateway.keys.usage_window."""
    where, params = _where(since, until, {"key_id": key_id})
    return await db.aexecute(
        "SELECT started_at, outcome, json_extract(record, '$.usage.prompt_tokens'),"
        " json_extract(record, '$.usage.completion_tokens'), json_extract(record, '$.usage.cached_tokens'),"
        f" json_extract(record, '$.cost') FROM audit{where}",
        params,
    )
