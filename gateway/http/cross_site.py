"""What a browser page may do to the client API (``/v1/...``, HTTP and WebSocket).

A pure ASGI layer that looks at headers only, in front of the routes (the admin surface has
its own rules, :mod:`gateway.http.admin_surface`). SDKs and agent CLIs send no ``Origin`` and no
``Sec-Fetch-Site``: they pass untouched. A web page cannot help sending them, so:

- **Foreign origins are refused**: a request whose ``Origin`` is not the gateway's own
  (the scheme and ``Host`` it was reached at, the same port under another loopback name, a
  ``--public-url``) or whose ``Sec-Fetch-Site`` is ``cross-site``/``same-site`` is a 403
  ``cross_origin`` in the route's error shape, before a byte of the body is read and before
  anything goes upstream. ``text/plain`` POSTs and ``new WebSocket(...)`` need no CORS
  preflight, so answering them would hand any page the operator's upstream keys.
- **Listed origins get real CORS** (``--cors-allow-origin``, exact ``scheme://host[:port]``):
  Starlette's ``CORSMiddleware`` answers their preflight ``OPTIONS`` and adds the
  ``Access-Control-*`` headers; WebSocket upgrades from them are let through.
- **Host allow-list while no client key is configured**: the loopback names, the bound
  address and every ``--public-url`` host (what the admin surface allows). A DNS-rebinding
  page reaches a keyless loopback gateway with its own name in ``Host``; 403 ``forbidden_host``.
  With client keys the key is the fence (proxies may present any name).

A refused WebSocket upgrade is answered before it is accepted (ASGI
``websocket.http.response``: a 403 with the OpenAI error body; without the extension the
close before accept becomes uvicorn's bare 403). A refused generation request (``POST`` to
a generation route) is not answered here: the refusal rides in the scope
(:func:`raise_refusal`) and the relay answers it with its one audit record, as it does a
missing key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.http.admin_surface import LOOPBACK_NAMES, WILDCARD_BINDS, host_name, origin_of
from gateway.live_settings import LiveSettings
from gateway.protocols.messages.room import error_json as anthropic_error
from gateway.protocols.openai_shapes import error_json as openai_error
from gateway.settings import Settings

#: Where a refusal for a generation request waits for the relay (see :func:`raise_refusal`).
SCOPE_KEY = "codebuddy2api.cross_site_refusal"
#: The routes whose refusals are audited by the relay (POST only).
GENERATION_SUFFIXES = ("/chat/completions", "/completions", "/embeddings", "/responses", "/responses/compact", "/messages")
#: Fetch metadata that says a request came from the page's own origin (or from no page).
SAME_ORIGIN_FETCH = frozenset({"same-origin", "none"})
#: Response headers a listed origin's scripts may read.
EXPOSED_HEADERS = ("x-request-id", "x-codebuddy2api-stream-mode", "retry-after", "x-codebuddy2api-upstream")


def is_api_path(path: str) -> bool:
    """``/v1/...``, also under a prefix such as ``/rollouts/{id}/v1/...``."""
    return path == "/v1" or path.startswith("/v1/") or ("/v1/" in path and path.startswith("/rollouts/"))


def cross_origin(detail: str) -> GatewayError:
    return GatewayError(
        "permission", "cross_origin",
        f"{detail}; the client API answers no web page but its own origin"
        " (an origin the operator trusts is listed with --cors-allow-origin)",
    )


def forbidden_host(host: str) -> GatewayError:
    return GatewayError(
        "permission", "forbidden_host",
        f"the gateway does not answer for host {host!r} while no client key is configured;"
        " reach it by a loopback name or a configured --public-url",
    )


def error_body(path: str, err: GatewayError) -> dict[str, Any]:
    """The route's error shape: Anthropic for the Messages routes, OpenAI for the rest."""
    return anthropic_error(err) if "/v1/messages" in path else openai_error(err)


def raise_refusal(scope: Scope) -> None:
    """Raise the refusal this layer left for a generation request (the relay calls it
    first, so the refused request has its audit record)."""
    refusal = scope.get(SCOPE_KEY)
    if refusal is not None:
        raise refusal


class CrossSiteGuard:
    """Refuses foreign origins (and, keyless, foreign hosts) on ``/v1``; CORS for listed origins.

    Whether client keys are configured follows the live settings through their listener
    (told of each new value when a request reads them), so no request pays a settings read
    here; a key added or removed at run time applies from the next request on."""

    def __init__(
        self,
        app: ASGIApp,
        live: LiveSettings,
        public_urls: Iterable[str] = (),
        bind_host: str = "",
        allow_origins: Iterable[str] = (),
        managed_keys: Callable[[], bool] = lambda: False,
    ) -> None:
        self.app = app
        self.static_keyed = bool(live.current.api_key)
        #: whether any managed client key exists (gateway/keys/): then /v1 needs a key too
        self.managed_keys = managed_keys
        live.listeners.append(self._settings_changed)
        urls = list(public_urls)
        self.hosts = set(LOOPBACK_NAMES) | {name for u in urls if (name := urlsplit(u).hostname)}
        if bind_host not in WILDCARD_BINDS:
            self.hosts.add(bind_host.strip("[]").lower())
        self.public_origins = frozenset(origin_of(u) for u in urls)
        self.allow_origins = frozenset(o.lower() for o in allow_origins)
        self.cors = CORSMiddleware(
            app, allow_origins=sorted(self.allow_origins), allow_methods=["GET", "POST"],
            allow_headers=["*"], expose_headers=list(EXPOSED_HEADERS), max_age=600,
        )

    def _settings_changed(self, current: Settings) -> None:
        self.static_keyed = bool(current.api_key)

    @property
    def keyed(self) -> bool:
        return self.static_keyed or self.managed_keys()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not is_api_path(scope.get("path", "")):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        origin = headers.get("origin")
        listed = origin is not None and origin.lower() in self.allow_origins
        err = self.refusal(scope, headers, listed)
        if err is None:
            if listed and scope["type"] == "http":
                return await self.cors(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await deny_upgrade(scope, receive, send, err)
        path = scope.get("path", "")
        if scope.get("method") == "POST" and path.endswith(GENERATION_SUFFIXES):
            return await self.app({**scope, SCOPE_KEY: err}, receive, send)  # answered (and audited) by the relay
        await JSONResponse(error_body(path, err), status_code=err.status)(scope, receive, send)

    def refusal(self, scope: Scope, headers: dict[str, str], listed: bool) -> GatewayError | None:
        """Why the request is refused, or None."""
        host = headers.get("host", "")
        if not self.keyed and host_name(host) not in self.hosts:
            return forbidden_host(host)
        if listed:
            return None
        origin = headers.get("origin")
        if origin is not None and not self.own_origin(scope, host, origin):
            return cross_origin(f"requests from the web page at {origin[:200]!r} are refused")
        fetch_site = headers.get("sec-fetch-site")
        if fetch_site is not None and fetch_site not in SAME_ORIGIN_FETCH:
            return cross_origin(f"a {fetch_site[:40]} request from a web page is refused")
        return None

    def own_origin(self, scope: Scope, host: str, origin: str) -> bool:
        """``origin`` is the gateway itself: the scheme and host it was reached at (the same
        port under another loopback name counts), or a ``--public-url``."""
        origin = origin.lower()
        if origin in self.public_origins:
            return True
        scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
        if origin == f"{scheme}://{host}".lower():
            return True
        try:
            parts = urlsplit(origin)
            port = parts.port
            own_port = urlsplit("//" + host).port
        except ValueError:
            return False
        return (parts.scheme == scheme and parts.hostname in LOOPBACK_NAMES
                and host_name(host) in LOOPBACK_NAMES and port == own_port)


async def deny_upgrade(scope: Scope, receive: Receive, send: Send, err: GatewayError) -> None:
    """Refuse a WebSocket upgrade before accepting it: the status and the OpenAI error body
    (``websocket.http.response``), else a close before accept (uvicorn: a bare 403)."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    body = orjson.dumps(openai_error(err))
    await send({
        "type": "websocket.http.response.start", "status": err.status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
