"""The I/O shell of rollouts: refuse calls for a frozen rollout (the key's claim is
:class:`~gateway.rollout.owners.OwnerClaims`, reached as ``recorder.owners``), commit each
call's record before its answer is released, record failed calls at their end, read back.

Commit before release: :meth:`RolloutRecorder.commit` is the run's ``before_release``
hook, awaited right before the terminal event (stream) or the JSON body is handed to the
client. It writes the record through the app's
:class:`~gateway.store.spill.DurableWriter` (the store, else the fsync'd spill journal;
its own bound decides when a slow store spills) and waits for that, bounded. A record
neither stored nor spilled marks the rollout incomplete with the reason; the client still
gets its answer, unless ``--capture-strict`` (then the protocol's error, code
``capture_failed``). Serialising and masking the record runs in a worker thread.

The success record is committed ``delivered: false``; :meth:`RolloutRecorder.released` (the
run's ``after_release`` hook, called once the terminal was handed to the client's
transport) writes the ``delivered`` mark. A gateway killed in between leaves the record
``delivered: false``: the read-back says the rollout is not complete and why.

What the store may not have yet (spilled records, incomplete reasons, pending ``delivered``
marks) is held in :class:`~gateway.rollout.unstored.UnstoredRolloutFacts` and laid over the
store's rows on a read-back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson
import structlog

from gateway.errors import GatewayError
from gateway.live_settings import LiveSettings
from gateway.redact import SECRETS
from gateway.rollout import owners
from gateway.rollout import store as rollout_store
from gateway.rollout.call_tokens import CallTokens
from gateway.rollout.experts import compacted
from gateway.rollout.labels import group_row
from gateway.rollout.records import call_record
from gateway.rollout.unstored import UnstoredRolloutFacts
from gateway.store.db import Store
from gateway.store.spill import DurableWriter

log = structlog.get_logger("gateway.rollout")

#: Seconds beyond the DurableWriter's own store bound for the journal's fsync.
SPILL_BOUND = 2.0
#: Seconds the frozen check may take (a store that does not answer: the call goes on).
FROZEN_CHECK_TIMEOUT = 1.0
#: Seconds reading a rollout's earlier calls for token-in may take.
HISTORY_TIMEOUT = 2.0


def frozen_error(rollout_id: str) -> GatewayError:
    return GatewayError("invalid_request", "rollout_frozen",
                        f"rollout {rollout_id!r} is frozen: it takes no more calls", param="rollout_id", status=409)


#: The error code of a call ended by ``POST /admin/api/rollouts/{id}/abort``.
ABORTED = "rollout_aborted"


def aborted_error(rollout_id: str) -> GatewayError:
    """What a call gets when its rollout is aborted (``POST .../abort``); its record says
    ``cancelled`` with this code."""
    return GatewayError("invalid_request", ABORTED, f"rollout {rollout_id!r} was aborted",
                        param="rollout_id", status=409)


def _has_experts(run: Any) -> bool:
    """The engine returned MoE routing (``routed_experts``) with this run's answer."""
    completion = run.completion if run.error is None else None
    data = completion.token_data if completion is not None else None
    return data is not None and data.routed_experts is not None


class RolloutRecorder:
    """One per app. ``pool`` returns the current upstream pool (llama.cpp look-ups go to
    the credential that answered)."""

    def __init__(self, db: Store, durable: DurableWriter, live: LiveSettings, pool: Callable[[], Any]) -> None:
        self.db = db
        self.durable = durable
        self.live = live
        self.pool = pool
        self.unstored = UnstoredRolloutFacts()  # what the store may not have yet (rollout/unstored.py)
        self.owners = owners.OwnerClaims(db)  # the claim of each call (gateway/rollout/owners.py)
        self.tokens = CallTokens(pool, lambda: self.live.current.capture_tokens)
        self._committed: dict[str, str] = {}  # call id -> outcome written before release
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failures = 0

    @property
    def enabled(self) -> bool:
        s = self.live.current
        return bool(s.capture_dir) or s.capture_tokens != "none" or s.token_in != "none" or self.token_in_configured

    @property
    def token_in_configured(self) -> bool:
        """Some upstream continues rollout calls as token ids (``token_in``)."""
        return any(c.upstream.token_in for c in self.pool().credentials)

    # -- before the call ---------------------------------------------------------------------

    async def refuse_frozen(self, rollout_id: str) -> None:
        """A GatewayError (409 ``rollout_frozen``) for a frozen rollout."""
        try:
            async with asyncio.timeout(FROZEN_CHECK_TIMEOUT):
                frozen = await self.db.arun(lambda c: rollout_store.is_frozen(c, rollout_id))
        except (TimeoutError, *self.db.errors) as exc:
            log.warning("rollout_frozen_check_failed", rollout=rollout_id, error=type(exc).__name__)
            return
        if frozen:
            raise frozen_error(rollout_id)

    async def history(self, rollout_id: str) -> list[dict[str, Any]]:
        """The rollout's call records so far (token-in's plan), bounded: a store that does
        not answer in time gives none (the call then goes the chat way, ``first_turn``)."""
        try:
            async with asyncio.timeout(HISTORY_TIMEOUT):
                found = await self.read(rollout_id)
        except (TimeoutError, *self.db.errors) as exc:
            log.warning("rollout_history_failed", rollout=rollout_id, error=type(exc).__name__)
            return []
        return found[0] if found is not None else []

    # -- at the terminal ---------------------------------------------------------------------

    async def commit(self, run: Any) -> None:
        """The run's ``before_release`` hook: the success record, durable, now."""
        source = self.tokens.source(run)
        prompt_ids = await self.tokens.prompt_ids(run, source)
        # the earlier calls, only to cut a continued call's routed experts to its new tokens
        history = await self.history(run.rollout_id) if _has_experts(run) else []
        ended_at = time.time()

        def build() -> dict[str, Any]:
            # not delivered yet: released() confirms it once the terminal was handed over
            record = call_record(run, "success", None, source, prompt_ids)
            if history:
                record = compacted(record, history)
            return {**record, "ended_at": ended_at, "delivered": False}

        reason, _ = await asyncio.gather(self._write(run.rollout_id, build), self._group(run))
        self._committed[run.record.request_id] = "success"
        if reason is not None and self.live.current.capture_strict:
            raise GatewayError("overloaded", "capture_failed",
                               "the call's record could not be made durable (--capture-strict)", retry_after=1)

    def released(self, run: Any) -> None:
        """The run's ``after_release`` hook: its terminal (or JSON body) was handed to the
        client's transport. Known here at once (a read-back through this process says
        delivered from now on), the ``delivered`` mark written in the background."""
        if run.rollout_id is None or run.error is not None or run.completion is None:
            return
        call_id = run.record.request_id
        self.unstored.delivered_call(run.rollout_id, call_id)
        self._background(self._confirm(run.rollout_id, call_id))

    async def _confirm(self, rollout_id: str, call_id: str) -> None:
        try:
            async with asyncio.timeout(self.durable.write_timeout + SPILL_BOUND):
                result = await self.durable.write("rollout_mark", [rollout_store.delivered_row(
                    rollout_id, call_id, time.time())])
        except TimeoutError:
            result = "timeout"
        if result == "stored":
            self.unstored.delivery_stored(call_id)
        elif result != "spilled":
            log.error("rollout_delivery_not_stored", rollout=rollout_id, call=call_id, result=result)

    async def _write(self, rollout_id: str, build: Callable[[], dict[str, Any]]) -> str | None:
        """Store or spill the record ``build()`` makes; the reason it is not durable, or
        None. Building (token lists can be long), serialising and masking run in a worker
        thread; the run is not changing meanwhile (its answer is whole)."""

        def serialise() -> tuple[dict[str, Any], tuple[Any, ...]]:
            record = build()
            return record, rollout_store.call_row(record, SECRETS.mask_bytes(orjson.dumps(record, default=str)))

        record, row = await asyncio.to_thread(serialise)
        try:
            async with asyncio.timeout(self.durable.write_timeout + SPILL_BOUND):
                result = await self.durable.write("rollout_call", [row])
        except TimeoutError:
            result = "timeout"
        if result == "spilled":
            self.unstored.spilled_call(rollout_id, record["call_id"], orjson.loads(row[4]))
        if result in ("stored", "spilled"):
            return None
        reason = f"call {record['call_id']}: record not durable ({result})"
        self.mark_incomplete(rollout_id, reason, record["call_id"])
        return reason

    def mark_incomplete(self, rollout_id: str, reason: str, key: str) -> None:
        """Kept here at once; written to the store in the background (it may be the store
        that failed: then this process still answers it)."""
        self.failures += 1
        self.unstored.incomplete_because(rollout_id, reason)
        log.error("rollout_incomplete", rollout=rollout_id, reason=reason)
        row = rollout_store.mark_row(rollout_id, "incomplete", time.time(), reason, key)
        self._background(self.durable.write("rollout_mark", [row]))

    # -- at the end --------------------------------------------------------------------------

    def finished(self, run: Any, outcome: str, error_code: str | None) -> None:
        """At the request's report: a call not committed as it ended (failed, cancelled,
        or cut after its terminal) is recorded now, in the background."""
        if run.rollout_id is None or not self.enabled:
            return
        if error_code == ABORTED:  # ended by the trainer: a cancelled call, not an engine failure
            outcome = "cancelled"
        if self._committed.pop(run.record.request_id, None) == outcome:
            return
        source = self.tokens.source(run)
        self._background(self._write(run.rollout_id, lambda: call_record(run, outcome, error_code, source)))
        self._background(self._group(run))

    async def _group(self, run: Any) -> None:
        """The group a call named (``x-rollout-group``), stored with each such call (an
        upsert: the latest named wins); a write that fails is logged, the record stands."""
        group = run.rollout_group
        if group is None:
            return
        try:
            async with asyncio.timeout(self.durable.write_timeout + SPILL_BOUND):
                result = await self.durable.write("rollout_group", [group_row(run.rollout_id, group, time.time())])
        except TimeoutError:
            result = "timeout"
        if result not in ("stored", "spilled"):
            log.error("rollout_group_not_stored", rollout=run.rollout_id, group=group, result=result)

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.durable.write_timeout + SPILL_BOUND)
        await self.tokens.aclose()

    # -- reading back ------------------------------------------------------------------------

    async def read(self, rollout_id: str) -> tuple[list[dict[str, Any]], list[tuple[str, float, str]]] | None:
        """The rollout's records and marks (store + what this process holds), or None."""
        held = self.unstored.held(rollout_id, lambda: not self.durable.spill_entries)

        def run(conn: Any) -> tuple[list[dict[str, Any]], list[tuple[str, float, str]]]:
            return rollout_store.load_calls(conn, rollout_id), rollout_store.load_marks(conn, rollout_id)

        records, marks = await self.db.arun(run)
        return self.unstored.over(rollout_id, held, records, marks)

    def forget(self, rollout_id: str) -> None:
        self.owners.forget(rollout_id)
        self.unstored.forget(rollout_id)
