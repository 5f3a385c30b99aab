"""Refusing what could not be recorded: every generation request leaves one audit record,
so when neither the store nor the spill journal can keep one, new generation requests are
turned away (503 ``recording_unavailable``, retryable) instead of served unrecorded.

The state comes from :meth:`gateway.store.spill.DurableWriter.unrecordable` (in memory,
no I/O): the journal's reservation failed at start-up (a nearly full disk: it is retried
every second), or the store cannot write while the journal is full or failing.
``--serve-unrecorded`` chooses availability instead: requests are served, and counted.
Either way ``codebuddy2api_unrecordable_requests_total{action}`` counts them, and a refused
request's own record still goes wherever it can (store, else journal, else counted lost).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from gateway.errors import GatewayError

log = structlog.get_logger("gateway.recording")

#: One log line per this many seconds while requests are refused or served unrecorded.
LOG_INTERVAL = 10.0
RECORDING_UNAVAILABLE = "recording_unavailable"


class RecordingGate:
    """Called once per generation request, after the client key check: raises the 503
    while no record can be kept (unless ``serve_unrecorded()``)."""

    def __init__(
        self,
        unrecordable: Callable[[], str | None],
        serve_unrecorded: Callable[[], bool],
        count: Callable[[str], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.unrecordable = unrecordable
        self.serve_unrecorded = serve_unrecorded
        self.count = count
        self.clock = clock
        self._logged_at: float | None = None

    def __call__(self) -> None:
        why = self.unrecordable()
        if why is None:
            return
        serve = self.serve_unrecorded()
        self.count("served" if serve else "refused")
        now = self.clock()
        if self._logged_at is None or now - self._logged_at >= LOG_INTERVAL:
            self._logged_at = now
            log.error("requests_unrecordable", why=why, action="served (--serve-unrecorded)" if serve else "refused")
        if serve:
            return
        raise GatewayError(
            "overloaded", RECORDING_UNAVAILABLE,
            "the gateway cannot record requests right now (store and spill journal unavailable); retry later",
            retry_after=5,
        )


def with_spill_hint(facts: dict[str, Any], journal: Any, serve_unrecorded: bool) -> dict[str, Any]:
    """The banner's facts, naming a spill journal whose reservation failed (and what the
    gateway does about it), so the operator sees it before the first refused request."""
    if journal is None or journal.reserved:
        return facts
    what = ("requests are SERVED UNRECORDED meanwhile (--serve-unrecorded)" if serve_unrecorded
            else "generation requests are refused (503 recording_unavailable) until it is")
    hint = (f"spill journal NOT reserved: {journal.max_bytes} bytes in {journal.path.parent}"
            f" ({journal.reserve_error or 'no space'}); /readyz is 503 and {what}; retried every second")
    return {**facts, "spill_reserved": False, "hints": [*facts.get("hints", []), hint]}
