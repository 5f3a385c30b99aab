"""The admin JSON API under ``/admin/api`` (used by the WebUI), behind one access guard.

Every admin route is mounted by :func:`admin_mount`, so access control lives in one place:
:class:`AdminGuard`. Until admin authentication lands (issue #8) it refuses any client that
is not on a loopback address with 403; an auth check replaces :func:`is_allowed` later.
"""

from __future__ import annotations

import ipaddress

from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin.audit_api import audit_routes
from gateway.admin.capture_api import capture_routes
from gateway.admin.credentials_api import credential_routes

__all__ = ["AdminGuard", "admin_mount", "is_allowed"]


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host == "localhost"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def is_allowed(scope: Scope) -> bool:
    """May this connection use the admin API? (#8 adds the admin token check here.)"""
    client = scope.get("client")
    return is_loopback(client[0] if client else None)


class AdminGuard:
    """Pure ASGI middleware in front of every admin route."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_allowed(scope):
            body = {"error": {"type": "permission_error", "code": "admin_forbidden",
                              "message": "the admin API only answers loopback clients"}}
            await JSONResponse(body, status_code=403)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def admin_routes() -> list[BaseRoute]:
    """Every admin route (other admin modules add theirs here)."""
    return [*audit_routes(), *credential_routes(), *capture_routes()]


def admin_mount() -> Mount:
    return Mount("/admin/api", routes=admin_routes(), middleware=[Middleware(AdminGuard)])
