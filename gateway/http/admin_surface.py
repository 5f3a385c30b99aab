"""What a browser may do to the admin surface (``/admin/...``, the WebUI at ``/ui``, ``/``).

A pure ASGI layer in front of the whole app, looking at headers only:

- **Host allow-list**: loopback names (``127.0.0.1``, ``localhost``, ``[::1]``, any port),
  the address the gateway is bound to (unless a wildcard) and the host of every
  ``--public-url``. A DNS-rebinding page reaches us with its own name in ``Host``
  (``evil.example``) and is refused.
- **State-changing requests** (POST/PUT/PATCH/DELETE): the body must be
  ``application/json`` (an HTML form or a "simple" cross-site ``fetch`` cannot send that
  without a CORS preflight, which is never granted); an ``Origin``, when sent, must be the
  gateway's own (``Origin: null`` never is); ``Sec-Fetch-Site``, when sent, must be
  ``same-origin`` or ``none``.

Authentication (the admin token or the session cookie) is the next fence, in
:mod:`gateway.admin.auth`; this one holds even for a request that carries valid credentials.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin.common import admin_error

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SAME_ORIGIN_FETCH = frozenset({"same-origin", "none"})


def is_admin_path(path: str) -> bool:
    return path == "/" or path.startswith(("/admin/", "/ui")) or path == "/admin"


def host_name(host: str) -> str | None:
    """The name in a ``Host`` header (``[::1]:8080`` -> ``::1``), lower-cased."""
    try:
        return urlsplit("//" + host).hostname
    except ValueError:
        return None


def origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


class AdminSurface:
    """Refuses foreign hosts, foreign origins and non-JSON writes on the admin surface."""

    def __init__(self, app: ASGIApp, public_urls: Iterable[str] = (), bind_host: str = "") -> None:
        self.app = app
        urls = list(public_urls)
        self.hosts = set(LOOPBACK_NAMES) | {name for u in urls if (name := urlsplit(u).hostname)}
        if bind_host not in WILDCARD_BINDS:  # clients of a specific address name it in Host
            self.hosts.add(bind_host.strip("[]").lower())
        self.public_origins = frozenset(origin_of(u) for u in urls)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_admin_path(scope.get("path", "")):
            refusal = self.refusal(scope)
            if refusal is not None:
                status, code, message = refusal
                await admin_error(status, code, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """(status, code, message) when the request is refused, else None."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host = headers.get("host", "")
        if host_name(host) not in self.hosts:
            return 403, "forbidden_host", (
                f"the admin surface does not answer for host {host!r}; "
                "reach it by a loopback name or a configured --public-url")
        if scope.get("method") not in UNSAFE_METHODS:
            return None
        origin = headers.get("origin")
        own = {f"{scope.get('scheme', 'http')}://{host}".lower()} | self.public_origins
        if origin is not None and origin.lower() not in own:
            return 403, "cross_origin", "a state-changing admin request must come from the gateway's own origin"
        fetch_site = headers.get("sec-fetch-site")
        if fetch_site is not None and fetch_site not in SAME_ORIGIN_FETCH:
            return 403, "cross_origin", f"a state-changing admin request must be same-origin (Sec-Fetch-Site: {fetch_site})"
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            return 415, "unsupported_media_type", "a state-changing admin request must send an application/json body"
        return None
