"""Who may use the admin API and the WebUI.

With no ``--admin-token``: loopback clients only. With one: ``Authorization: Bearer
<token>`` (scripts), or the WebUI's session cookie, which ``POST /admin/login`` hands out
in exchange for the token: HttpOnly, SameSite=Strict, scoped to ``/admin``, signed with a
key derived from the token (stateless, so every worker and replica accepts it; changing
the token logs every session out). A state-changing request that rides on the cookie must
carry an ``Origin`` equal to the gateway's own.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Scope

COOKIE = "cb2a_admin"
SESSION_SECONDS = 12 * 3600
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


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


def _admin_token(scope: Scope) -> str | None:
    token = scope["app"].state.live.current.admin_token
    return token.get_secret_value() if token is not None else None


def _key(token: str) -> bytes:
    return hashlib.sha256(b"codebuddy2api-admin-session:" + token.encode()).digest()


def make_session(token: str, now: float | None = None) -> str:
    expires = int((now or time.time()) + SESSION_SECONDS)
    signature = hmac.new(_key(token), str(expires).encode(), hashlib.sha256).hexdigest()
    return f"{expires}.{signature}"


def valid_session(token: str, value: str | None) -> bool:
    if not value or "." not in value:
        return False
    expires, _, signature = value.partition(".")
    if not expires.isdigit() or int(expires) < time.time():
        return False
    expected = hmac.new(_key(token), expires.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(signature, expected)


def _own_origin(request: Request) -> str:
    return f"{request.url.scheme}://{request.headers.get('host', request.url.netloc)}"


def check_admin(request: Request) -> tuple[bool, str, str]:
    """(allowed, actor, reason when refused)."""
    token = _admin_token(request.scope)
    if token is None:
        client = request.client.host if request.client else None
        if is_loopback(client):
            return True, "loopback", ""
        return False, "", "the admin API answers loopback clients only (no --admin-token is set)"
    auth = request.headers.get("authorization") or ""
    if auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(), token.encode()):
        return True, "admin-token", ""
    if valid_session(token, request.cookies.get(COOKIE)):
        if request.method in UNSAFE_METHODS and request.headers.get("origin") != _own_origin(request):
            return False, "", "a state-changing request must come from the gateway's own origin"
        return True, "admin-session", ""
    return False, "", "log in with the admin token first"


async def login(request: Request) -> Response:
    token = _admin_token(request.scope)
    if token is None:
        return JSONResponse({"authenticated": is_loopback(request.client.host if request.client else None),
                             "auth_required": False})
    origin = request.headers.get("origin")
    if origin is not None and origin != _own_origin(request):
        return JSONResponse({"error": {"type": "permission_error", "code": "bad_origin",
                                       "message": "login must come from the gateway's own origin"}}, status_code=403)
    try:
        payload: Any = await request.json()
    except ValueError:
        payload = None
    given = payload.get("token") if isinstance(payload, dict) else None
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), token.encode()):
        return JSONResponse({"error": {"type": "authentication_error", "code": "bad_admin_token",
                                       "message": "that is not the admin token"}}, status_code=401)
    response = JSONResponse({"authenticated": True, "auth_required": True})
    response.set_cookie(COOKIE, make_session(token), max_age=SESSION_SECONDS, path="/admin", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


async def logout(request: Request) -> Response:
    response = JSONResponse({"authenticated": False})
    response.delete_cookie(COOKIE, path="/admin", httponly=True, samesite="strict")
    return response


async def session(request: Request) -> Response:
    allowed, actor, _ = check_admin(request)
    return JSONResponse({"authenticated": allowed, "actor": actor,
                         "auth_required": _admin_token(request.scope) is not None})


def auth_routes() -> list[BaseRoute]:
    """Routes outside the guard (they are how one gets past it)."""
    return [
        Route("/admin/login", login, methods=["POST"]),
        Route("/admin/logout", logout, methods=["POST"]),
        Route("/admin/session", session, methods=["GET"]),
    ]
