"""The managed keys' tables (migration 10) and their one-transaction operations.

``client_keys``: one row per key (its SHA-256, never the secret). ``client_key_usage``:
requests and tokens per key and UTC day; ``tokens`` includes what open reservations hold,
so a reservation is refused when it would take the day past ``daily_tokens``, or the
budget period (the sum of its days' rows) past ``budget_tokens``.
``client_key_requests``: one row per counted request, kept a few minutes after it ends:
rpm and tpm are counted over the last 60 seconds of these rows (a sliding window, not a
calendar minute) and ``max_concurrent`` over the open ones.

A reservation is held on a lease (``lease_until``, :data:`LEASE` seconds, renewed by its
process while the request runs: :func:`renew`). One whose process died, or whose
settlement could not reach the store, is reclaimed by the next reservation of its key once
the lease has run out: it stops counting against ``max_concurrent`` and its reserved
tokens count as used until its settlement arrives (the settlement is journaled when the
store is out: gateway/keys/limiter.py), which then corrects them. A reclaimed row is
``open = 0, reclaimed = 1`` (``used`` = what it reserved): to a replica of the version
before leases, mid-way through a rolling upgrade, it reads as an ended request, which is
what it now is.

Every function here blocks: callers run them in a worker thread. A reservation is one
transaction that first locks the key's row (PostgreSQL ``SELECT ... FOR UPDATE``; SQLite's
``BEGIN IMMEDIATE`` locks the file), so two replicas reserving for one key take turns
and the limits hold exactly across them. Times come from the database's clock.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.keys.model import KeyLimits, ManagedKey
from gateway.keys.periods import period_days
from gateway.keys.quota import WINDOW, Ask, Counts, Grant, Refusal, decide
from gateway.store.db import Store

#: Seconds a reservation's lease runs; its process renews it every :data:`RENEW_EVERY`.
#: A reservation nobody renews (its process died, the store was out) is reclaimed by the
#: next reservation of its key at most this long after the last renewal.
LEASE = 30.0
RENEW_EVERY = LEASE / 3
#: Seconds a row may be stamped ahead of the clock and still count. Further ahead, the clock
#: stepped back since (SQLite uses this machine's clock): such rows are out of the rpm/tpm
#: window and their leases have run out, so a 1 h backward step does not lock a key for an
#: hour (issue #40); at worst the window forgets the requests made before the step.
CLOCK_SLACK = 5.0
#: A row from before leases (no ``lease_until``) is taken as lost this long after it began.
STALE_OPEN = 3600.0
#: Ended requests are deleted once this old (past the window).
KEEP_ENDED = 2 * WINDOW
#: A reclaimed reservation whose settlement never came is deleted once this old (its
#: reserved tokens stay counted as the day's usage: the safe side).
KEEP_RECLAIMED = 2 * 86400.0


_COLUMNS = "key_id, name, prefix, secret_hash, limits, metadata, created_at, revoked_at"


def day_of(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d")


def _limits_json(limits: KeyLimits) -> str:
    data = {f.name: getattr(limits, f.name) for f in fields(limits)}
    if limits.models is not None:
        data["models"] = list(limits.models)
    return orjson.dumps(data).decode()


def _key(row: Any) -> ManagedKey:
    key_id, name, prefix, secret_hash, limits, metadata, created_at, revoked_at = row
    known = {f.name for f in fields(KeyLimits)}
    data = {k: v for k, v in orjson.loads(limits).items() if k in known}  # a newer version's fields: ignored
    if data.get("models") is not None:
        data["models"] = tuple(data["models"])
    return ManagedKey(str(key_id), str(name), str(prefix), str(secret_hash), KeyLimits(**data),
                      float(created_at), None if revoked_at is None else float(revoked_at), orjson.loads(metadata))


def _now(conn: Any, db: Store) -> float:
    return float(conn.execute(f"SELECT {db.now_sql}").fetchone()[0])


def insert(db: Store, key: ManagedKey) -> None:
    db.run(lambda c: c.execute(
        f"INSERT INTO client_keys ({_COLUMNS}, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (key.key_id, key.name, key.prefix, key.secret_hash, _limits_json(key.limits),
         orjson.dumps(key.metadata).decode(), key.created_at, key.revoked_at, key.created_at),
    ))


def load_all(db: Store) -> list[ManagedKey]:
    return [_key(r) for r in db.execute(f"SELECT {_COLUMNS} FROM client_keys ORDER BY created_at, key_id")]


def update(db: Store, key: ManagedKey) -> None:
    """Write a key's name, limits and metadata (a change through the admin API)."""
    db.run(lambda c: c.execute(
        "UPDATE client_keys SET name = ?, limits = ?, metadata = ?, updated_at = ? WHERE key_id = ?",
        (key.name, _limits_json(key.limits), orjson.dumps(key.metadata).decode(), time.time(), key.key_id),
    ))


def revoke(db: Store, key_id: str) -> bool:
    """Mark a key revoked (kept, so its audit history still names it); False if unknown."""

    def run(conn: Any) -> bool:
        now = _clock(conn, db)
        cursor = conn.execute(
            "UPDATE client_keys SET revoked_at = COALESCE(revoked_at, ?), updated_at = ? WHERE key_id = ?",
            (now, now, key_id),
        )
        return bool(cursor.rowcount)

    return db.run_tx(run)


def usage_today(db: Store) -> dict[str, dict[str, int]]:
    """Requests and settled tokens of every key today (open reservations left out)."""

    def run(conn: Any) -> dict[str, dict[str, int]]:
        day = day_of(_clock(conn, db))
        rows = conn.execute("SELECT key_id, requests, tokens FROM client_key_usage WHERE day = ?", (day,)).fetchall()
        held = dict(conn.execute(
            "SELECT key_id, SUM(reserved) FROM client_key_requests WHERE open = 1 AND day = ? GROUP BY key_id", (day,)
        ).fetchall())
        return {str(k): {"requests_today": int(r), "tokens_today": int(t) - int(held.get(k) or 0)} for k, r, t in rows}

    return db.run_tx(run, write=False)


def budget_counts(db: Store, keys: list[ManagedKey]) -> tuple[float, dict[str, Counts]]:
    """The database's clock and, for each key, what its budgets have taken: the day's tokens
    and its ``budget_period``'s tokens and cost (settled plus held), one read transaction."""

    def run(conn: Any) -> tuple[float, dict[str, Counts]]:
        now = _clock(conn, db)
        day = day_of(now)
        out: dict[str, Counts] = {}
        for key in keys:
            row = conn.execute(_DAY_TOKENS, (key.key_id, day)).fetchone()
            first, last = period_days(now, key.limits.budget_period)
            tokens, cost = conn.execute(_PERIOD_USAGE, (key.key_id, first, last)).fetchone()
            out[key.key_id] = Counts(now, day_tokens=int(row[0] if row else 0), period_tokens=int(tokens or 0),
                                     period_cost=int(cost or 0))
        return now, out

    return db.run_tx(run, write=False)


#: One scan of the key's recent rows (ended ones are deleted after KEEP_ENDED, so the
#: scan holds the last two minutes and the held ones): requests and tokens in the window
#: (a reclaimed row's ``used`` is what it reserved), its oldest request, the held
#: requests; and the day's tokens.
_IN_WINDOW = "at > ? AND at <= ?"
_COUNTS = (
    f"SELECT COUNT(CASE WHEN {_IN_WINDOW} THEN 1 END),"
    f" COALESCE(SUM(CASE WHEN {_IN_WINDOW} THEN (CASE WHEN open = 1 THEN reserved ELSE used END) ELSE 0 END), 0),"
    f" MIN(CASE WHEN {_IN_WINDOW} THEN at END), COALESCE(SUM(CASE WHEN open = 1 THEN 1 ELSE 0 END), 0),"
    " (SELECT tokens FROM client_key_usage WHERE key_id = ? AND day = ?)"
    " FROM client_key_requests WHERE key_id = ? AND (at > ? OR open = 1)"
)
#: Held reservations whose lease ran out: reclaimed (no longer concurrent; what they
#: reserved counts as used until their settlement arrives). A lease further ahead than any
#: renewal can set was stamped before the clock stepped back: it has run out too.
_RECLAIM = (
    "UPDATE client_key_requests SET open = 0, reclaimed = 1, used = reserved, used_cost = reserved_cost"
    f" WHERE key_id = ? AND open = 1 AND (COALESCE(lease_until, at + {STALE_OPEN}) < ? OR lease_until > ?)"
)
_DAY_TOKENS = "SELECT tokens FROM client_key_usage WHERE key_id = ? AND day = ?"
#: The tokens and the cost of a budget period: its days' rows (days are YYYY-MM-DD: they sort as text).
_PERIOD_USAGE = ("SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(cost_nanos), 0) FROM client_key_usage"
                 " WHERE key_id = ? AND day >= ? AND day <= ?")
_USAGE_ADD = (
    "INSERT INTO client_key_usage (key_id, day, requests, tokens, cost_nanos) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (key_id, day) DO UPDATE SET requests = client_key_usage.requests + excluded.requests,"
    " tokens = client_key_usage.tokens + excluded.tokens, cost_nanos = client_key_usage.cost_nanos + excluded.cost_nanos"
)


def _clock(conn: Any, db: Store) -> float:
    """Replicas on several machines share the database's clock; one machine its own."""
    return _now(conn, db) if db.shared else time.time()


def reserve(db: Store, key: ManagedKey, request_id: str, tokens: int) -> Refusal | None:
    """Count one request and hold exactly ``tokens`` for it, or say which limit refuses it."""
    decision = admit(db, key, request_id, Ask(input_tokens=tokens))
    return decision if isinstance(decision, Refusal) else None


def admit(db: Store, key: ManagedKey, request_id: str, ask: Ask) -> Grant | Refusal:
    """Count one request and hold what :func:`gateway.keys.quota.decide` grants it (its
    output cap lowered to what remains when the client named none), or the refusal."""
    limits = key.limits
    k = key.key_id

    def run(conn: Any) -> Grant | Refusal:
        if db.dialect == "postgres":  # one reservation per key at a time, on every replica
            conn.execute("SELECT key_id FROM client_keys WHERE key_id = ? FOR UPDATE", (k,))
        now = _clock(conn, db)
        day = day_of(now)
        conn.execute(_RECLAIM, (k, now, now + LEASE + CLOCK_SLACK))
        if limits.rpm is None and limits.tpm is None and limits.max_concurrent is None:
            row = conn.execute(_DAY_TOKENS, (k, day)).fetchone()  # a budget alone: the day's row is enough
            counts = Counts(now, day_tokens=int(row[0] if row else 0))
        else:
            window = now - WINDOW
            count, window_tokens, oldest, open_now, used = conn.execute(
                _COUNTS, (window, now + CLOCK_SLACK) * 3 + (k, day, k, window)
            ).fetchone()
            counts = Counts(now, int(count), int(window_tokens), None if oldest is None else float(oldest),
                            int(open_now), int(used or 0))
        if limits.budget_tokens is not None or limits.budget_cost is not None:
            first, last = period_days(now, limits.budget_period)
            tokens, cost = conn.execute(_PERIOD_USAGE, (k, first, last)).fetchone()
            counts = dataclasses.replace(counts, period_tokens=int(tokens or 0), period_cost=int(cost or 0))
        decision = decide(limits, counts, ask)
        if isinstance(decision, Refusal):
            return decision
        conn.execute(  # a request that generates nothing is ended as it is counted
            "INSERT INTO client_key_requests (request_id, key_id, at, day, reserved, used, open, lease_until, reserved_cost)"
            " VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?)",
            (request_id, k, now, day, decision.tokens, 1 if ask.generates else 0, now + LEASE, decision.cost),
        )
        conn.execute(_USAGE_ADD, (k, day, 1, decision.tokens, decision.cost))
        _purge(conn, k, now)
        return decision

    return db.run_tx(run)


def _purge(conn: Any, key_id: str, now: float) -> None:
    """Ended rows past the window (or stamped ahead of a clock that stepped back), and
    reclaimed rows whose settlement never came."""
    conn.execute(
        "DELETE FROM client_key_requests WHERE key_id = ?"
        " AND ((open = 0 AND reclaimed = 0 AND (at < ? OR at > ?)) OR (reclaimed = 1 AND at < ?))",
        (key_id, now - KEEP_ENDED, now + CLOCK_SLACK, now - KEEP_RECLAIMED),
    )


def renew(db: Store, request_ids: list[str]) -> int:
    """Extend the leases of this process's held reservations; how many were still held."""

    def run(conn: Any) -> int:
        until = _clock(conn, db) + LEASE
        renewed = 0
        for start in range(0, len(request_ids), 500):
            chunk = request_ids[start:start + 500]
            cursor = conn.execute(
                f"UPDATE client_key_requests SET lease_until = ? WHERE open = 1 AND request_id IN"
                f" ({', '.join('?' for _ in chunk)})", (until, *chunk),
            )
            renewed += max(0, cursor.rowcount)
        return renewed

    return db.run_tx(run) if request_ids else 0


def settle_in(conn: Any, request_id: str, used: int, cost: int | None = None) -> bool:
    """In a transaction: a reservation (held or reclaimed) becomes what the request really
    used and cost (nano-units; ``None``: unknown, what it held stays counted); False if there
    was none to settle. Idempotent: a replayed settlement finds the row settled and changes
    nothing."""
    row = conn.execute(
        "SELECT key_id, day, reserved, reserved_cost FROM client_key_requests"
        " WHERE request_id = ? AND (open = 1 OR reclaimed = 1)",
        (request_id,),
    ).fetchone()
    if row is None:
        return False
    key_id, day, reserved, reserved_cost = row
    spent = int(reserved_cost) if cost is None else cost
    conn.execute("UPDATE client_key_requests SET open = 0, reclaimed = 0, used = ?, used_cost = ? WHERE request_id = ?",
                 (used, spent, request_id))
    conn.execute(
        "UPDATE client_key_usage SET tokens = tokens + ?, cost_nanos = cost_nanos + ? WHERE key_id = ? AND day = ?",
        (used - int(reserved), spent - int(reserved_cost), key_id, day),
    )
    return True


def settle(db: Store, request_id: str, used: int, cost: int | None = None) -> bool:
    """:func:`settle_in` in its own transaction."""
    return db.run_tx(lambda conn: settle_in(conn, request_id, used, cost))


def count_usage_in(conn: Any, db: Store, request_id: str, key_id: str, used: int, cost: int = 0) -> bool:
    """In a transaction: a request of a key without counted limits, its usage after the
    fact. Kept as an ended request row (keyed by the request id), so a replayed count is
    counted once; False when it was counted already."""
    now = _clock(conn, db)
    cursor = conn.execute(
        "INSERT INTO client_key_requests (request_id, key_id, at, day, reserved, used, open, used_cost)"
        " VALUES (?, ?, ?, ?, 0, ?, 0, ?) ON CONFLICT (request_id) DO NOTHING",
        (request_id, key_id, now, day_of(now), used, cost),
    )
    if cursor.rowcount != 1:
        return False
    conn.execute(_USAGE_ADD, (key_id, day_of(now), 1, used, cost))
    _purge(conn, key_id, now)
    return True


def count_usage(db: Store, request_id: str, key_id: str, used: int, cost: int = 0) -> bool:
    """:func:`count_usage_in` in its own transaction."""
    return db.run_tx(lambda conn: count_usage_in(conn, db, request_id, key_id, used, cost))


#: The spill kinds of settlements (gateway/store/spill.py replays them): a row is
#: (request_id, used, cost) for a reservation, (request_id, key_id, used, cost) for a count
#: (cost in nano-units, None when unknown; a journal from before money budgets has rows
#: without it).
SETTLE_KIND, COUNT_KIND = "key_settle", "key_count"


def statements(db: Store) -> dict[str, Any]:
    """The DurableWriter statements of settlements: callables over a batch of rows (each
    idempotent, so a replay cut short and retried counts every request once)."""

    def settle_rows(conn: Any, rows: Any) -> None:
        for request_id, used, *cost in rows:
            spent = cost[0] if cost else None
            settle_in(conn, str(request_id), int(used), None if spent is None else int(spent))

    def count_rows(conn: Any, rows: Any) -> None:
        for request_id, key_id, used, *cost in rows:
            count_usage_in(conn, db, str(request_id), str(key_id), int(used), int(cost[0] or 0) if cost else 0)

    return {SETTLE_KIND: settle_rows, COUNT_KIND: count_rows}
