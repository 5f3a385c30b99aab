"""Admin JSON routes over the upstream pool: list credentials (fingerprints and labels
only), add one (probed at once: its result is in the answer; a key already in the pool for
that base URL is a 409), delete one added here, disable, re-enable, reset cooldowns. Keys
go in, never come out."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import BAD_BODY, NotAnObject, admin_error, json_object
from gateway.errors import GatewayError
from gateway.store import audit_queries
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.urls import UpstreamURLError, check_upstream_url

#: Seconds the probe of a newly added credential may take (the admin's request waits on it).
ADD_PROBE_TIMEOUT = 5.0
#: The longest label an operator may give a credential.
MAX_LABEL = 100


def _pool(request: Request) -> UpstreamPool:
    return request.app.state.relay.pool


#: The window of each credential's success rate and last error (from the audit store).
STATS_WINDOW = 86400.0


async def list_credentials(request: Request) -> Response:
    """Every credential (never a key), with its upstream attempts over the last day."""
    pool = _pool(request)
    now = time.time()
    stats = await audit_queries.credential_stats(request.app.state.db, now - STATS_WINDOW)
    empty = {"attempts": 0, "succeeded": 0, "failed": 0, "success_rate": None, "last_error": None}
    credentials = [c.public(now) | {"stats": stats.get(c.fingerprint, empty)} for c in pool.credentials]
    return JSONResponse({"credentials": credentials, "in_flight": pool.in_flight, "stats_window": STATS_WINDOW})


async def add_credential(request: Request) -> Response:
    try:
        payload = await json_object(request)
    except NotAnObject:
        return admin_error(400, *BAD_BODY)
    base_url, api_key = payload.get("base_url"), payload.get("api_key")
    name = payload.get("upstream") or "admin"
    try:  # the same check as --upstream-url (gateway.upstream.urls), and the path must end in /v1
        check_upstream_url(base_url, request.app.state.live.current.allow_upstream_host, require_v1=True)
    except UpstreamURLError as exc:
        return admin_error(400, "invalid_upstream_url", str(exc), "base_url")
    if api_key is not None and (not isinstance(api_key, str) or not api_key or not api_key.isprintable()
                                or any(c.isspace() for c in api_key)):
        return admin_error(400, "invalid_value", "api_key must be a non-empty string without spaces or control characters", "api_key")
    if not isinstance(name, str) or not name.isprintable():
        return admin_error(400, "invalid_value", "upstream must be a printable string", "upstream")
    label = payload.get("label")
    if label is not None and (not isinstance(label, str) or not label.strip() or not label.isprintable()
                              or len(label) > MAX_LABEL):
        return admin_error(400, "invalid_value", f"label must be a printable string of 1 to {MAX_LABEL} characters", "label")
    pool = _pool(request)
    upstream = next((c.upstream for c in pool.credentials if c.upstream.name == name and c.upstream.base_url == base_url), None)
    credential = Credential(upstream or Upstream(str(name), base_url), api_key, label=label or "admin API")
    twin = pool.twin_of(credential)  # one credential per key and base URL, whatever the upstream name
    if twin is not None:
        return admin_error(409, "credential_exists", f"this key is already configured for this base URL as {twin.id!r}"
                           f" ({twin.label or 'no label'})", "api_key")
    credential.added_by_admin, credential.added_at = True, pool.clock()
    probe = await probe_new(request, credential)
    state = request.app.state.credential_state
    # off the event loop: a slow store must not stall the streams this process serves
    await state.db.acall(state.add_credential, credential.id, credential.upstream.name, base_url, api_key, credential.label)
    pool.add(credential)
    if probe["status"] in (401, 403):  # the key is refused: out of rotation, probed again later
        refused = GatewayError("upstream", "upstream_auth_failed", probe["result"])
        refused.upstream_status = probe["status"]
        pool.report_failure(credential, "*", refused)
    request.app.state.observability.metrics.declare_configuration(pool)  # its upstream's series, at zero
    return JSONResponse(credential.public() | {"probe": probe}, status_code=201)


async def probe_new(request: Request, credential: Credential) -> dict[str, object]:
    """``GET {base_url}/models`` with the new key, before it serves anything: whether the
    URL and key work, shown to the admin (and kept as the credential's last probe)."""
    client = request.app.state.relay.upstream
    try:
        async with asyncio.timeout(ADD_PROBE_TIMEOUT + 1):
            ok, result = await client.probe(credential, timeout=ADD_PROBE_TIMEOUT)
    except TimeoutError:
        ok, result = False, "timed out"
    credential.last_probe_at, credential.last_probe_result = time.time(), result
    status = int(result[5:]) if result.startswith("HTTP ") and result[5:].isdigit() else None
    hint = None
    if status == 404:
        hint = "the upstream has no /models under this URL: an OpenAI-compatible base URL ends in /v1"
    elif status in (401, 403):
        hint = "the upstream refused this key; the credential is disabled until a probe succeeds"
    elif not ok and status is None:
        hint = "the upstream could not be reached from the gateway"
    return {"ok": ok, "result": result, "status": status, "hint": hint}


async def delete_credential(request: Request) -> Response:
    """Forget a credential added through this API (and its key, in the store). Configured
    ones (flag, environment, --config) are refused: they would come back at the next start."""
    pool = _pool(request)
    credential_id = request.path_params["credential_id"]
    try:
        credential = pool.get(credential_id)
    except KeyError:
        return admin_error(404, "credential_not_found", f"no credential {credential_id!r}", "credential_id")
    if not credential.added_by_admin:
        return admin_error(409, "credential_configured", "this credential comes from --upstream-url/--config; "
                           "remove it from --config (or the key file) and reload (POST /admin/api/reload, SIGHUP), or from the flags and restart", "credential_id")
    await request.app.state.db.acall(request.app.state.credential_state.delete_credential, credential_id)
    pool.remove(credential_id)
    return JSONResponse({"deleted": credential_id, "credential": credential.public()})


def _action(name: str):  # type: ignore[no-untyped-def]
    async def endpoint(request: Request) -> Response:
        pool = _pool(request)
        credential_id = request.path_params["credential_id"]
        try:
            credential = getattr(pool, name)(credential_id)
        except KeyError:
            return admin_error(404, "credential_not_found", f"no credential {credential_id!r}", "credential_id")
        return JSONResponse(credential.public())

    return endpoint


def credential_routes() -> list[BaseRoute]:
    return [
        Route("/credentials", list_credentials, methods=["GET"]),
        Route("/credentials", add_credential, methods=["POST"]),
        Route("/credentials/{credential_id}", delete_credential, methods=["DELETE"]),
        Route("/credentials/{credential_id}/enable", _action("enable"), methods=["POST"]),
        Route("/credentials/{credential_id}/disable", _action("disable"), methods=["POST"]),
        Route("/credentials/{credential_id}/reset", _action("reset_cooldowns"), methods=["POST"]),
    ]
