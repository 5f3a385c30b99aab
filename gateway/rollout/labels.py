"""A trainer's labels on a rollout: its rewards and its group (docs/capture.md "Rewards and
groups").

A reward is a number with optional details (an object), on the rollout (``call_id`` None)
or on one of its calls; one per rollout and one per call, upserted by (rollout, call), so
posting the same reward again (a retried request, a second replica) changes nothing and a
new value replaces the old. A group id (GRPO: the rollouts of one prompt) comes with a
call (the ``x-rollout-group`` header, :mod:`gateway.rollout.ids`) or from the admin API; the latest one given wins.

Pure apart from the blocking store functions, which callers run in a worker thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.rollout.ids import VALID
from gateway.store.db import upsert

REWARD_UPSERT = upsert("rollout_rewards", ("reward_id", "rollout_id", "call_id", "reward", "details", "at"), "reward_id")
GROUP_UPSERT = upsert("rollout_groups", ("rollout_id", "group_id", "at"), "rollout_id")
#: The DurableWriter statement for a group that came with a call.
STATEMENTS = {"rollout_group": GROUP_UPSERT}


class BadLabel(ValueError):
    """A reward or group body the admin API refuses (400): ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Reward:
    reward: float
    details: dict[str, Any] | None
    call_id: str | None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Reward:
        """``{"reward": number, "details": object?, "call_id": string?}``, checked."""
        value = body.get("reward")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadLabel("reward", "reward must be a finite number")
        details = body.get("details")
        if details is not None and not isinstance(details, dict):
            raise BadLabel("details", "details must be a JSON object")
        call_id = body.get("call_id")
        if call_id is not None and (not isinstance(call_id, str) or not call_id):
            raise BadLabel("call_id", "call_id must be a call id (the x-request-id of one of the rollout's calls)")
        unknown = sorted(set(body) - {"reward", "details", "call_id"})
        if unknown:
            raise BadLabel(unknown[0], f"unknown field {unknown[0]!r}: reward, details, call_id")
        return cls(float(value), details, call_id)

    def row(self, rollout_id: str, at: float) -> tuple[Any, ...]:
        call = self.call_id or ""
        details = orjson.dumps(self.details).decode() if self.details is not None else None
        return (f"{rollout_id}\x1f{call}", rollout_id, call, self.reward, details, at)


def check_group(value: Any, param: str = "group_id") -> str:
    """A group id: the rollout id's alphabet (1-128 of ``[A-Za-z0-9._:-]``)."""
    if not isinstance(value, str) or not VALID.fullmatch(value):
        raise BadLabel(param, f"{param} must be 1-128 characters of A-Z a-z 0-9 . _ : -")
    return value


def group_row(rollout_id: str, group_id: str, at: float) -> tuple[Any, ...]:
    return (rollout_id, group_id, at)


def _reward_view(reward: float, details: str | None, at: float) -> dict[str, Any]:
    return {"reward": float(reward), "details": orjson.loads(details) if details else None, "at": float(at)}


def load_labels(conn: Any, rollout_id: str) -> dict[str, Any]:
    """``{"group_id", "reward", "call_rewards"}`` of one rollout (the read-back's part)."""
    group = conn.execute("SELECT group_id FROM rollout_groups WHERE rollout_id = ?", (rollout_id,)).fetchall()
    rows = conn.execute(
        "SELECT call_id, reward, details, at FROM rollout_rewards WHERE rollout_id = ? ORDER BY call_id", (rollout_id,)
    ).fetchall()
    own = [_reward_view(r, d, a) for c, r, d, a in rows if c == ""]
    return {
        "group_id": group[0][0] if group else None,
        "reward": own[0] if own else None,
        "call_rewards": {c: _reward_view(r, d, a) for c, r, d, a in rows if c != ""},
    }


def all_labels(conn: Any) -> dict[str, dict[str, Any]]:
    """Every rollout's group and own reward (the listing): rollout -> {group_id, reward}."""
    out: dict[str, dict[str, Any]] = {}
    for rollout_id, group_id in conn.execute("SELECT rollout_id, group_id FROM rollout_groups").fetchall():
        out.setdefault(rollout_id, {"group_id": None, "reward": None})["group_id"] = group_id
    rows = conn.execute("SELECT rollout_id, reward FROM rollout_rewards WHERE call_id = ''").fetchall()
    for rollout_id, reward in rows:
        out.setdefault(rollout_id, {"group_id": None, "reward": None})["reward"] = float(reward)
    return out


def delete_labels(conn: Any, rollout_id: str) -> None:
    conn.execute("DELETE FROM rollout_rewards WHERE rollout_id = ?", (rollout_id,))
    conn.execute("DELETE FROM rollout_groups WHERE rollout_id = ?", (rollout_id,))
