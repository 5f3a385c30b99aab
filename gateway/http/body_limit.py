"""The request-body limit, as a thin ASGI layer: ``--max-body-bytes`` for every route.

The limit is enforced where the body is read, not before the app runs, so every route
keeps its own order (the client key and the admin guard look at headers first; a refused
request never reads its body). A declared ``Content-Length`` over the limit fails the first
``receive()`` without reading a byte; a chunked body fails once the bytes counted so far
pass it. Either way :class:`BodyTooLarge` is raised into the reader: the relay turns it
into an audited 413, and anything else that lets it escape gets a 413 here in the route's
own error shape. A response that goes out before the body was read asks the server to
close the connection (``connection: close``), so an unread body is not drained either.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ErrorCode, GatewayError

#: Login is the one route an anonymous client may post to: it never needs more than this.
LOGIN_BODY_BYTES = 16 * 1024
LOGIN_PATHS = frozenset({"/admin/login", "/admin/logout"})


class BodyTooLarge(Exception):
    """The request body is (or declares to be) over the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over the limit of {limit} bytes")
        self.limit = limit

    def error(self) -> GatewayError:
        return GatewayError("too_large", ErrorCode.REQUEST_TOO_LARGE, str(self))


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def has_body(scope: Scope) -> bool:
    length = declared_length(scope)
    if length:
        return True
    return any(name == b"transfer-encoding" for name, _ in scope.get("headers", ()))


class BodyLimit:
    """Pure ASGI middleware; ``render(path, error)`` gives the route's error response."""

    def __init__(self, app: ASGIApp, limit: int, render: Callable[[str, GatewayError], Response]) -> None:
        self.app = app
        self.limit = limit
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = LOGIN_BODY_BYTES if scope.get("path") in LOGIN_PATHS else self.limit
        declared = declared_length(scope)
        counted = 0
        body_done = not has_body(scope)
        started = False

        async def limited_receive() -> Message:
            nonlocal counted, body_done
            if declared is not None and declared > limit:
                raise BodyTooLarge(limit)
            message = await receive()
            if message["type"] == "http.request":
                counted += len(message.get("body", b""))
                if counted > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            return message

        async def closing_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if not body_done:  # answered without reading the body: do not drain it either
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, limited_receive, closing_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await self.render(scope.get("path", ""), exc.error())(scope, receive, closing_send)
