"""Who may use the admin API and the WebUI.

Always a token: ``--admin-token``, or without one a random token generated at start-up
(Jupyter's pattern) and shown once as a login URL (``.../ui/?token=...``) on stderr;
loopback alone is no credential (any web page the operator opens can reach loopback).
Scripts send ``Authorization: Bearer <token>``; the WebUI exchanges the token, with
``POST /admin/login``, for a session cookie: HttpOnly, SameSite=Strict, scoped to
``/admin``, signed with a key derived from the token over its expiry and the session
epoch (:mod:`gateway.admin.sessions`: ``POST /admin/logout`` draws a new epoch in the
store, which revokes every cookie on every worker and replica; a new token does too). A
state-changing request that rides on the cookie must carry an ``Origin`` equal to the
gateway's own. Failed token attempts (login, Bearer) are rate-limited per client address
and in total (:mod:`gateway.admin.throttle`): 429 with ``Retry-After``. Host, Origin and
content-type are checked before any of this by :mod:`gateway.http.admin_surface`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Scope

from gateway.admin.common import admin_error
from gateway.admin.sessions import SessionEpoch
from gateway.admin.throttle import AttemptThrottle, retry_after_header

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


@dataclass(frozen=True)
class AdminAccess:
    """The admin token in force: configured, or generated for this run."""

    token: str
    generated: bool

    @classmethod
    def from_settings(cls, configured: Any, generated: str | None = None) -> AdminAccess:
        """``--admin-token`` when set; else ``generated`` (handed down to workers) or a new one."""
        if configured is not None and configured.get_secret_value():
            return cls(configured.get_secret_value(), generated=False)
        return cls(generated or secrets.token_urlsafe(32), generated=True)

    def login_url(self, base_url: str) -> str | None:
        """The URL that logs a browser in; None for a configured token (never printed)."""
        return f"{base_url.rstrip('/')}/ui/?token={self.token}" if self.generated else None

    @property
    def signing_key(self) -> bytes:
        return session_key(self.token)


def login_base_url(host: str, port: int, public_urls: list[str]) -> str:
    """Where an operator opens the WebUI: the first public URL, else the bound address
    (loopback for a wildcard bind)."""
    if public_urls:
        return public_urls[0]
    if host in ("", "0.0.0.0", "::") or is_loopback(host):
        host = "127.0.0.1" if host != "::1" else "[::1]"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _admin_token(scope: Scope) -> str:
    access: AdminAccess = scope["app"].state.admin_access
    return access.token


def session_key(token: str) -> bytes:
    """The session cookie's signing key (a secret in its own right)."""
    return hashlib.sha256(b"codebuddy2api-admin-session:" + token.encode()).digest()


def make_session(token: str, now: float | None = None, epoch: str = "") -> str:
    expires = int((now or time.time()) + SESSION_SECONDS)
    signature = hmac.new(session_key(token), f"{expires}.{epoch}".encode(), hashlib.sha256).hexdigest()
    return f"{expires}.{epoch}.{signature}"


def valid_session(token: str, value: str | None, epoch: str = "") -> bool:
    """Signed by this token, not expired, and issued in the current ``epoch``."""
    if not value or value.count(".") != 2:
        return False
    expires, given_epoch, signature = value.split(".")
    if not expires.isdigit() or int(expires) < time.time():
        return False
    expected = hmac.new(session_key(token), f"{expires}.{given_epoch}".encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(signature, expected) and hmac.compare_digest(given_epoch.encode(), epoch.encode())


def _sessions(scope: Scope) -> SessionEpoch | None:
    return getattr(scope["app"].state, "admin_sessions", None)


def _epoch(scope: Scope) -> str:
    sessions = _sessions(scope)
    return sessions.current() if sessions is not None else ""


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization") or ""
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _throttle(request: Request) -> AttemptThrottle | None:
    return getattr(request.app.state, "admin_throttle", None)


def too_many_attempts(request: Request) -> Response | None:
    """The 429 for a client that must wait before its next token attempt, or None."""
    throttle = _throttle(request)
    wait = throttle.retry_after(_client(request)) if throttle is not None else 0.0
    if wait <= 0:
        return None
    response = admin_error(429, "too_many_attempts", "too many wrong admin-token attempts: wait before the next one")
    response.headers["retry-after"] = retry_after_header(wait)
    return response


def _attempted(request: Request, ok: bool) -> None:
    throttle = _throttle(request)
    if throttle is not None:
        (throttle.succeeded if ok else throttle.failed)(_client(request))


def guarded_check(request: Request) -> tuple[bool, str, str] | Response:
    """:func:`check_admin` behind the attempt throttle: a 429 while this client must
    wait (a Bearer attempt only: a session cookie is no guess), each Bearer outcome counted."""
    bearer = _bearer(request) is not None
    if bearer and (refusal := too_many_attempts(request)) is not None:
        return refusal
    allowed, actor, reason = check_admin(request)
    if bearer:
        _attempted(request, actor == "admin-token")
    return allowed, actor, reason


def check_admin(request: Request) -> tuple[bool, str, str]:
    """(allowed, actor, reason when refused)."""
    token = _admin_token(request.scope)
    given = _bearer(request)
    if given is not None and hmac.compare_digest(given.encode(), token.encode()):
        return True, "admin-token", ""
    if valid_session(token, request.cookies.get(COOKIE), _epoch(request.scope)):
        # its value was checked against our own origins by gateway.http.admin_surface; a browser
        # always sends one on a write, so a cookie-borne write without one is not a browser's
        if request.method in UNSAFE_METHODS and request.headers.get("origin") is None:
            return False, "", "a state-changing request must come from the gateway's own origin"
        return True, "admin-session", ""
    return False, "", "log in with the admin token first (the login URL printed at start-up, or --admin-token)"


async def login(request: Request) -> Response:
    if (refusal := too_many_attempts(request)) is not None:
        return refusal
    token = _admin_token(request.scope)
    try:
        payload: Any = await request.json()
    except ValueError:
        payload = None
    given = payload.get("token") if isinstance(payload, dict) else None
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), token.encode()):
        _attempted(request, False)
        return JSONResponse({"error": {"type": "authentication_error", "code": "bad_admin_token", "param": "token",
                                       "message": "that is not the admin token"}}, status_code=401)
    _attempted(request, True)
    response = JSONResponse({"authenticated": True, "auth_required": True, "actor": "admin-session"})
    response.set_cookie(COOKIE, make_session(token, epoch=_epoch(request.scope)), max_age=SESSION_SECONDS,
                        path="/admin", httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return response


async def logout(request: Request) -> Response:
    """Revokes every session (a new epoch in the store), not only this browser's cookie,
    when the caller is logged in; without a valid session or token it only drops the cookie."""
    checked = guarded_check(request)
    if isinstance(checked, Response):
        return checked
    sessions = _sessions(request.scope)
    if checked[0] and sessions is not None:
        await sessions.revoke(actor=f"logout ({checked[1]})")
    response = JSONResponse({"authenticated": False, "revoked": bool(checked[0] and sessions is not None)})
    response.delete_cookie(COOKIE, path="/admin", httponly=True, samesite="strict")
    return response


async def session(request: Request) -> Response:
    checked = guarded_check(request)
    if isinstance(checked, Response):
        return checked
    allowed, actor, _ = checked
    return JSONResponse({"authenticated": allowed, "actor": actor, "auth_required": True})


def auth_routes() -> list[BaseRoute]:
    """Routes outside the guard (they are how one gets past it)."""
    return [
        Route("/admin/login", login, methods=["POST"]),
        Route("/admin/logout", logout, methods=["POST"]),
        Route("/admin/session", session, methods=["GET"]),
    ]
