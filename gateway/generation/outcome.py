"""The one writer of a generation request's outcome.

Every way a generation request ends goes through :class:`RequestOutcome`: it writes
``outcome``, ``error_code`` and ``http_status`` on the record, then reports the record
exactly once (the first decision wins; later calls are ignored, so a path that races
another — a client disconnect against the end of a stream — cannot report twice or
overwrite a decided outcome).

``outcome`` is one of ``success | error | cancelled | invalid | refused``. An exception
that is not a :class:`~gateway.errors.GatewayError` is a bug of ours: :func:`internal_error`
logs it (ERROR, with the traceback and the request id) and turns it into the 500 every
room renders in its own shape (code ``internal_error``); the client never sees the
traceback.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from gateway.errors import ErrorCode, GatewayError
from gateway.generation.record import RequestRecord

log = structlog.get_logger("gateway.outcome")

#: The audit keeps this much of an error's message (the WebUI shows it beside the code).
ERROR_MESSAGE_MAX = 500


def internal_error(exc: BaseException, request_id: str, where: str) -> GatewayError:
    """An unexpected exception as the client-safe 500, logged with its traceback."""
    log.error("internal_error", request_id=request_id, where=where, exc_info=exc)
    return GatewayError("internal", ErrorCode.INTERNAL_ERROR, f"internal error ({type(exc).__name__})")


class RequestOutcome:
    """Decides and writes how one request ended, then reports it once."""

    def __init__(self, record: RequestRecord, report: Callable[[], None]) -> None:
        self.record = record
        self._report = report
        self.reported = False

    def _decide(self, outcome: str, error: GatewayError | None = None, http_status: int | None = None) -> None:
        if self.reported:
            return
        self.reported = True
        record = self.record
        record.outcome = outcome
        if error is not None:
            record.error_code = str(error.code)
            record.error_message = error.message[:ERROR_MESSAGE_MAX]
            if error.code == ErrorCode.RESPONSE_TOO_LARGE:
                record.budget_exceeded = True
        if http_status is not None:
            record.http_status = http_status
        self._report()

    def succeeded(self) -> None:
        self._decide("success")

    def failed(self, error: GatewayError, committed: bool = False) -> None:
        """An error: before the status line it is the HTTP status; after it, the stream
        stays 200 and the error went out as the room's in-stream error event."""
        self._decide("error", error, None if committed else error.status)

    def refused(self, error: GatewayError) -> None:
        """Turned away at the door (no valid key, no capacity): nothing went upstream."""
        self._decide("refused", error, error.status)

    def invalid(self, error: GatewayError) -> None:
        """The client's request is wrong: nothing went upstream."""
        self._decide("invalid", error, error.status)

    def cancelled(self, http_status: int | None = None) -> None:
        """The client went away before the answer was complete."""
        if self.reported:
            return
        self.record.error_code = str(ErrorCode.CLIENT_DISCONNECTED)
        self._decide("cancelled", None, http_status)
