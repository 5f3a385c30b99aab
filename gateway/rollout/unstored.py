"""What this process knows of its rollouts that the store may not have yet.

Three kinds of fact, each written through the :class:`~gateway.store.spill.DurableWriter`
and kept here until the store surely has it: a call record the store did not take (it is
in the spill journal until the replay), a reason a rollout is incomplete (written in the
background: it may be the store that failed), a ``delivered`` mark not yet stored. A
read-back through this process lays them over the store's rows, so it stays whole during
a store outage.

Pure state (no I/O, no clock): :class:`~gateway.rollout.recorder.RolloutRecorder` feeds it
and reads it; it imports nothing of the recorder.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

from gateway.rollout.store import DELIVERED

#: Delivered marks not yet in the store this process remembers (least recent go first).
PENDING_DELIVERIES = 100_000

#: A rollout's marks, each (kind, at, reason or call id).
Marks = list[tuple[str, float, str]]


class UnstoredRolloutFacts:
    """Spilled call records, incomplete reasons and pending ``delivered`` marks, by rollout."""

    def __init__(self, max_delivered: int = PENDING_DELIVERIES) -> None:
        self.max_delivered = max_delivered
        #: rollout -> reasons it is incomplete, as this process saw them (also in the store)
        self.incomplete: dict[str, list[str]] = defaultdict(list)
        #: records the store did not take yet (in the spill journal): rollout -> call id -> record
        self.spilled: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
        #: call id -> rollout: terminals handed to the client whose ``delivered`` mark the
        #: store has not taken yet (this process answers them meanwhile; bounded)
        self.delivered: OrderedDict[str, str] = OrderedDict()

    def spilled_call(self, rollout_id: str, call_id: str, record: dict[str, Any]) -> None:
        self.spilled[rollout_id][call_id] = record

    def incomplete_because(self, rollout_id: str, reason: str) -> None:
        self.incomplete[rollout_id].append(reason)

    def delivered_call(self, rollout_id: str, call_id: str) -> None:
        """Its terminal was handed on; the mark is not stored yet (the oldest dropped past the bound)."""
        self.delivered[call_id] = rollout_id
        if len(self.delivered) > self.max_delivered:
            self.delivered.popitem(last=False)

    def delivery_stored(self, call_id: str) -> None:
        self.delivered.pop(call_id, None)

    def held(self, rollout_id: str, journal_empty: Callable[[], bool]) -> tuple[list[dict[str, Any]], list[str]]:
        """The rollout's spilled records and incomplete reasons, taken before the store is read
        (a record replayed meanwhile is then in one or the other). An empty journal (asked
        only while something is spilled) was replayed: the store has every spilled record now."""
        if self.spilled and journal_empty():
            self.spilled.clear()
        return list(self.spilled.get(rollout_id, {}).values()), list(self.incomplete.get(rollout_id, []))

    def over(
        self, rollout_id: str, held: tuple[list[dict[str, Any]], list[str]],
        records: list[dict[str, Any]], marks: Marks,
    ) -> tuple[list[dict[str, Any]], Marks] | None:
        """The store's records and marks with what :meth:`held` gave and the pending
        ``delivered`` marks laid over them (the store's row wins); None: nothing at all."""
        local, reasons = held
        by_id = {r["call_id"]: r for r in records}
        for r in local:
            by_id.setdefault(r["call_id"], r)
        stored_reasons = {reason for kind, _, reason in marks if kind == "incomplete"}
        marks += [("incomplete", 0.0, r) for r in reasons if r not in stored_reasons]
        marks += [(DELIVERED, 0.0, call) for call, r in list(self.delivered.items()) if r == rollout_id]
        if not by_id and not marks:
            return None
        return list(by_id.values()), marks

    def forget(self, rollout_id: str) -> None:
        self.spilled.pop(rollout_id, None)
        self.incomplete.pop(rollout_id, None)
        for call in [c for c, r in self.delivered.items() if r == rollout_id]:
            del self.delivered[call]
