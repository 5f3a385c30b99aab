"""Rollout rows in the shared store (migration 9): call records and marks.

Call records are written through the :class:`~gateway.store.spill.DurableWriter` (kind
``rollout_call``, an upsert by call id, so a replayed spill never duplicates one); marks
(``incomplete`` with its reason, ``frozen``, ``delivered`` naming a call) are kind
``rollout_mark``.

Delivery: a success record is committed with ``delivered: false`` before its terminal is
released; a ``delivered`` mark follows once the terminal was handed to the client's
transport. A success still ``delivered: false`` is a call no client may have received (the
gateway died in between): the read-back names it in ``undelivered`` and says the rollout is
not complete; a client that retried it forked the trajectory (``forks``). Records from
before have no ``delivered`` field and count as delivered. Reads are blocking
functions over a :class:`~gateway.store.db.Store` connection: callers run them in a
worker thread (``db.arun``).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.rollout.chain import RolloutChain, chain_of
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


#: The mark kind that says a call's terminal reached the client's transport (its key and
#: reason are the call id).
DELIVERED = "delivered"


def delivered_row(rollout_id: str, call_id: str, at: float) -> tuple[Any, ...]:
    return mark_row(rollout_id, DELIVERED, at, call_id, call_id)


def with_delivery(records: list[dict[str, Any]], marks: list[tuple[str, float, str]]) -> list[dict[str, Any]]:
    """The records with ``delivered: true`` where a ``delivered`` mark names the call, or
    where a later call extends it token for token (its client had the answer: the mark
    was lost with the gateway, the delivery was not)."""
    delivered = {reason for kind, _, reason in marks if kind == DELIVERED}
    out = [{**r, "delivered": True} if r.get("delivered") is False and r.get("call_id") in delivered else r
           for r in records]
    if not any(is_undelivered(r) for r in out):
        return out
    ordered, chain = _ordered(out)
    extended = {c.previous_call_id for r in ordered
                if (c := chain.continuity(str(r.get("call_id")))) is not None and c.prefix == "exact"}
    return [{**r, "delivered": True} if is_undelivered(r) and r.get("call_id") in extended else r for r in out]


def is_undelivered(record: dict[str, Any]) -> bool:
    """A success no client is known to have received (the gateway stopped between the
    record's commit and the terminal's hand-over). Failed and cancelled calls were never
    delivered as answers; records from before delivery was recorded count as delivered."""
    return record.get("outcome") == "success" and record.get("delivered") is False


def undelivered_reason(call_id: str) -> str:
    return (f"call {call_id}: recorded as a success, but its answer is not known to have reached the client"
            " (the gateway stopped before the terminal event was handed over)")


def _call_order(record: dict[str, Any]) -> tuple[float, str]:
    return record.get("started_at") or 0, record.get("call_id") or ""


def _ordered(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], RolloutChain]:
    ordered = sorted(records, key=_call_order)
    return ordered, chain_of(ordered)


def with_order(records: list[dict[str, Any]], marks: list[tuple[str, float, str]] | None = None) -> list[dict[str, Any]]:
    """Call order (``started_at``, then call id), ``seq`` from 0, and each call's
    continuity against the calls before it; ``delivered`` as the ``marks`` say."""
    ordered, chain = _ordered(with_delivery(records, marks or []))
    return _numbered(ordered, chain)


def _numbered(ordered: list[dict[str, Any]], chain: RolloutChain) -> list[dict[str, Any]]:
    out = []
    for seq, record in enumerate(ordered):
        cont = chain.continuity(str(record.get("call_id")))
        out.append({**record, "seq": seq, "continuity": cont.as_dict() if cont else None})
    return out


def snapshot(
    records: list[dict[str, Any]], marks: list[tuple[str, float, str]], rollout_id: str,
    exclude_undelivered: bool = False,
) -> dict[str, Any]:
    """``GET /admin/api/rollouts/R``: the rollout's state and its calls in order.

    Not ``complete`` when a mark says so or a success was never confirmed delivered;
    ``forks``: each call that extends a call another call already extended (a retry of an
    undelivered call, or a harness sampling twice from one point), ``forked`` when any.
    ``exclude_undelivered``: ``calls`` and ``forks`` as if the undelivered calls were never
    made (they are still named in ``undelivered``)."""
    resolved = with_delivery(records, marks)
    undelivered = [str(r.get("call_id")) for r in sorted(resolved, key=_call_order) if is_undelivered(r)]
    if exclude_undelivered:
        resolved = [r for r in resolved if not is_undelivered(r)]
    ordered, chain = _ordered(resolved)
    incomplete = [reason for kind, _, reason in marks if kind == "incomplete"]
    incomplete += [undelivered_reason(c) for c in undelivered]
    return {
        "rollout_id": rollout_id,
        "complete": not incomplete,
        "incomplete": incomplete,
        "frozen": any(kind == "frozen" for kind, _, _ in marks),
        "undelivered": undelivered,
        "forked": bool(chain.forks),
        "forks": [{"call_id": call, "extends": previous} for call, previous in chain.forks],
        "calls": _numbered(ordered, chain),
    }


def trajectory(
    records: list[dict[str, Any]], rollout_id: str, marks: list[tuple[str, float, str]] | None = None,
    exclude_undelivered: bool = False,
) -> dict[str, Any]:
    """The segments; ``exclude_undelivered``: as if the calls no client is known to have
    received were never made (a retried one then leaves no fork)."""
    resolved = with_delivery(records, marks or [])
    if exclude_undelivered:
        resolved = [r for r in resolved if not is_undelivered(r)]
    return {"rollout_id": rollout_id, "segments": _ordered(resolved)[1].segments()}


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
    """Blocking: the rollout's records in call order (``capture export`` on the store),
    delivery resolved as the read-back does."""
    records, marks = db.run(lambda conn: (load_calls(conn, rollout_id), load_marks(conn, rollout_id)))
    return with_order(records, marks)
