"""Rollout rows in the shared store (migration 9): call records and marks.

Call records are written through the :class:`~gateway.store.spill.DurableWriter` (kind
``rollout_call``, an upsert by call id, so a replayed spill never duplicates one); marks
(``incomplete`` with its reason, ``frozen``) are kind ``rollout_mark``. Reads are blocking
functions over a :class:`~gateway.store.db.Store` connection: callers run them in a
worker thread (``db.arun``).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.rollout.chain import chain_of
from gateway.rollout.labels import all_labels, delete_labels
from gateway.store.db import Store, upsert

CALL_UPSERT = upsert("rollout_calls", ("call_id", "rollout_id", "started_at", "ended_at", "record"), "call_id")
MARK_UPSERT = upsert("rollout_marks", ("mark_id", "rollout_id", "kind", "at", "reason"), "mark_id")
#: The DurableWriter statements for rollout rows (registered before it replays).
STATEMENTS = {"rollout_call": CALL_UPSERT, "rollout_mark": MARK_UPSERT}


def call_row(record: dict[str, Any], masked_json: bytes) -> tuple[Any, ...]:
    return (record["call_id"], record["rollout_id"], record["started_at"], record["ended_at"], masked_json.decode())


def mark_row(rollout_id: str, kind: str, at: float, reason: str, key: str) -> tuple[Any, ...]:
    return (f"{rollout_id}\x1f{kind}\x1f{key}", rollout_id, kind, at, reason)


def load_calls(conn: Any, rollout_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT record FROM rollout_calls WHERE rollout_id = ? ORDER BY started_at, call_id", (rollout_id,)
    ).fetchall()
    return [orjson.loads(r[0]) for r in rows]


def load_marks(conn: Any, rollout_id: str) -> list[tuple[str, float, str]]:
    rows = conn.execute(
        "SELECT kind, at, reason FROM rollout_marks WHERE rollout_id = ? ORDER BY at, mark_id", (rollout_id,)
    ).fetchall()
    return [(str(k), float(a), str(r)) for k, a, r in rows]


def is_frozen(conn: Any, rollout_id: str) -> bool:
    rows = conn.execute(
        "SELECT 1 FROM rollout_marks WHERE rollout_id = ? AND kind = 'frozen'", (rollout_id,)
    ).fetchall()
    return bool(rows)


def with_order(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call order (``started_at``, then call id), ``seq`` from 0, and each call's
    continuity against the calls before it."""
    ordered = sorted(records, key=lambda r: (r.get("started_at") or 0, r.get("call_id") or ""))
    chain = chain_of(ordered)
    out = []
    for seq, record in enumerate(ordered):
        cont = chain.continuity(str(record.get("call_id")))
        out.append({**record, "seq": seq, "continuity": cont.as_dict() if cont else None})
    return out


def snapshot(
    records: list[dict[str, Any]], marks: list[tuple[str, float, str]], rollout_id: str
) -> dict[str, Any]:
    """``GET /admin/api/rollouts/R``: the rollout's state and its calls in order."""
    incomplete = [reason for kind, _, reason in marks if kind == "incomplete"]
    return {
        "rollout_id": rollout_id,
        "complete": not incomplete,
        "incomplete": incomplete,
        "frozen": any(kind == "frozen" for kind, _, _ in marks),
        "calls": with_order(records),
    }


def trajectory(records: list[dict[str, Any]], rollout_id: str) -> dict[str, Any]:
    ordered = sorted(records, key=lambda r: (r.get("started_at") or 0, r.get("call_id") or ""))
    return {"rollout_id": rollout_id, "segments": chain_of(ordered).segments()}


def list_rollouts(conn: Any, since: float | None, limit: int, group: str | None = None) -> list[dict[str, Any]]:
    """Rollouts updated at or after ``since`` (of ``group`` when given), most recent first,
    each with its group and its own reward."""
    calls = conn.execute(
        "SELECT rollout_id, COUNT(*), MAX(ended_at) FROM rollout_calls GROUP BY rollout_id"
    ).fetchall()
    marks = conn.execute("SELECT rollout_id, kind, MAX(at) FROM rollout_marks GROUP BY rollout_id, kind").fetchall()
    out: dict[str, dict[str, Any]] = {}
    for rollout_id, count, updated in calls:
        out[rollout_id] = {"rollout_id": rollout_id, "calls": int(count), "complete": True, "frozen": False,
                           "updated_at": float(updated)}
    for rollout_id, kind, at in marks:
        entry = out.setdefault(rollout_id, {"rollout_id": rollout_id, "calls": 0, "complete": True,
                                            "frozen": False, "updated_at": float(at)})
        entry["updated_at"] = max(entry["updated_at"], float(at))
        if kind == "incomplete":
            entry["complete"] = False
        elif kind == "frozen":
            entry["frozen"] = True
    labels = all_labels(conn)
    for rollout_id, entry in out.items():
        entry.update(labels.get(rollout_id) or {"group_id": None, "reward": None})
    listed = [e for e in out.values() if (since is None or e["updated_at"] >= since)
              and (group is None or e["group_id"] == group)]
    listed.sort(key=lambda e: (-e["updated_at"], e["rollout_id"]))
    return listed[:limit]


def delete_rollout(conn: Any, rollout_id: str) -> None:
    conn.execute("DELETE FROM rollout_calls WHERE rollout_id = ?", (rollout_id,))
    conn.execute("DELETE FROM rollout_marks WHERE rollout_id = ?", (rollout_id,))
    delete_labels(conn, rollout_id)


def export_records(db: Store, rollout_id: str) -> list[dict[str, Any]]:
    """Blocking: the rollout's records in call order (``capture export`` on the store)."""
    return with_order(db.run(lambda conn: load_calls(conn, rollout_id)))
