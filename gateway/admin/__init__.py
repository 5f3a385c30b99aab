"""The admin JSON API under ``/admin/api`` (used by the WebUI), behind one access guard.

Every admin route is mounted by :func:`admin_mount`, so access control lives in one place:
:class:`AdminGuard`, which asks :func:`gateway.admin.auth.guarded_check` (the admin token,
configured or generated at start-up, or the WebUI session cookie). Host, Origin and
content-type are checked before that, for the whole admin surface, by
:class:`gateway.http.admin_surface.AdminSurface`; after it, :class:`StoreBound` bounds the
wait on the store (503 ``store_unavailable``, never a 500 after 30 s).
"""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin.audit_api import audit_routes
from gateway.admin.auth import auth_routes, guarded_check
from gateway.admin.capture_api import capture_routes
from gateway.admin.credentials_api import credential_routes
from gateway.admin.engines_api import engine_routes
from gateway.admin.envelope_keys_api import envelope_key_routes
from gateway.admin.keys_api import key_routes
from gateway.admin.reload_api import reload_routes
from gateway.admin.rollout_abort_api import rollout_abort_routes
from gateway.admin.rollout_export_api import rollout_export_routes
from gateway.admin.rollout_labels_api import rollout_label_routes
from gateway.admin.rollouts_api import rollout_routes
from gateway.admin.settings_api import settings_routes
from gateway.admin.status_api import status_routes
from gateway.admin.store_bound import StoreBound

__all__ = ["AdminGuard", "admin_mount", "auth_routes"]


class AdminGuard:
    """Pure ASGI middleware in front of every admin route."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            checked = guarded_check(request)  # a 429 while this client must wait before a token attempt
            if isinstance(checked, Response):
                await checked(scope, receive, send)
                return
            allowed, actor, reason = checked
            if not allowed:
                status = 403 if "origin" in reason else 401
                kind = "permission_error" if status == 403 else "authentication_error"
                body = {"error": {"type": kind, "code": "admin_forbidden" if status == 403 else "admin_login_required",
                                  "message": reason}}
                await JSONResponse(body, status_code=status)(scope, receive, send)
                return
            scope.setdefault("state", {})["admin_actor"] = actor
        await self.app(scope, receive, send)


def admin_routes() -> list[BaseRoute]:
    """Every admin route (other admin modules add theirs here)."""
    return [*audit_routes(), *credential_routes(), *capture_routes(), *rollout_export_routes(), *rollout_routes(),
            *rollout_label_routes(), *rollout_abort_routes(), *settings_routes(), *status_routes(),
            *envelope_key_routes(), *key_routes(), *engine_routes(), *reload_routes()]


def admin_mount() -> Mount:
    return Mount("/admin/api", routes=admin_routes(), middleware=[Middleware(AdminGuard), Middleware(StoreBound)])
