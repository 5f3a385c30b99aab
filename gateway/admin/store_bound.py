"""A bound on how long an admin request may wait for the store before it answers.

Admin routes read and write the store (audit, keys, rollouts, status counts). A hung or
stopped PostgreSQL used to hold them until the connection pool gave up (500 after 30 s,
issue #40). :class:`StoreBound` gives each admin request :data:`ADMIN_STORE_TIMEOUT`
seconds until its response starts, and answers a store error or a wait past it with a
retryable 503 ``store_unavailable`` in the admin error shape (``Retry-After: 1``), never a
500. Once the response has started (a long audit export streaming page by page) the bound
is lifted: its pages are each bounded by the store's own connection wait.
"""

from __future__ import annotations

import asyncio

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.admin.common import admin_error

log = structlog.get_logger("gateway.admin")

#: Seconds an admin request may wait on the store before its response starts.
ADMIN_STORE_TIMEOUT = 10.0


class StoreBound:
    """Pure ASGI middleware in front of the admin routes (after the access guard)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        db = scope["app"].state.db
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                bound.reschedule(None)
            await send(message)

        try:
            async with asyncio.timeout(ADMIN_STORE_TIMEOUT) as bound:
                await self.app(scope, receive, sending)
        except (TimeoutError, *db.errors) as exc:
            if started:
                raise
            log.warning("admin_store_unavailable", path=scope.get("path"), error=type(exc).__name__)
            response = admin_error(503, "store_unavailable", "the store did not answer in time; retry shortly"
                                   " (a change may still have been applied)")
            response.headers["retry-after"] = "1"
            await response(scope, receive, send)
