"""Re-reading ``--config`` (and the key file) while serving: ``POST /admin/api/reload`` and
``SIGHUP`` (a single-process ``serve``; with ``--workers`` uvicorn's supervisor answers
SIGHUP itself by replacing each worker, which reads the file anew).

The new credentials are built off the event loop from the same files the start-up read; a
bad file is refused with its one line and changes nothing. Then, on the loop, the pool
swaps its configured credentials (``UpstreamPool.replace_configured``): kept ones keep
their learned state, new ones adopt what the store holds for them, gone ones leave, and an
answer in flight on a gone one ends normally (its lease stays valid). The keys of gone
credentials stay masked for the life of the process. ``[models]`` tables need no reload:
they are read again whenever the file changes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import admin_error
from gateway.redact import SECRETS
from gateway.settings import SettingsError
from gateway.upstream.config import configured_credentials

log = structlog.get_logger("gateway.config")


class NothingToReload(Exception):
    """The gateway runs on the simulator or admin-added credentials only: no file to read."""


async def reload_config(app: Any) -> dict[str, Any]:
    """Re-read the configuration and apply it to the pool; raises SettingsError (a bad
    file: nothing changed) or NothingToReload."""
    settings = app.state.live.current
    if not settings.config and not settings.upstream_url:
        raise NothingToReload("no --config or --upstream-url to re-read")
    async with app.state.reload_lock:
        state = app.state.credential_state
        fresh, states = await asyncio.to_thread(lambda: (configured_credentials(settings), state.load_versions()))
        pool = app.state.relay.pool
        known = {c.id for c in pool.credentials}
        pool.state.adopt([c for c in fresh if c.id not in known], states)
        before = {c.id: c for c in pool.credentials}
        added, removed, superseded = pool.replace_configured(fresh)
        for credential_id in superseded:  # the config holds their keys now: one credential each
            await asyncio.to_thread(state.forget_added, credential_id)
        retired: set[str] = app.state.retired_keys
        retired.update(before[cid].api_key or "" for cid in (*removed, *superseded))
        SECRETS.set(f"{app.state.secrets_owner}:retired", retired)  # a gone key is still a secret
        app.state.observability.metrics.declare_configuration(pool)
    log.info("config_reloaded", added=added, removed=removed, superseded=superseded, credentials=len(pool.credentials))
    return {"reloaded_at": time.time(), "added": added, "removed": removed, "superseded": superseded,
            "credentials": [c.public() for c in pool.credentials]}


async def reload_endpoint(request: Request) -> Response:
    try:
        return JSONResponse(await reload_config(request.app))
    except SettingsError as exc:
        return admin_error(400, "invalid_config", str(exc))
    except NothingToReload as exc:
        return admin_error(409, "nothing_to_reload", str(exc))


async def reload_on_signal(app: Any) -> None:
    """SIGHUP: the same reload; a refusal is one log line (the running pool is kept)."""
    try:
        await reload_config(app)
    except (SettingsError, NothingToReload) as exc:
        log.error("config_reload_refused", reason=str(exc))


def reload_routes() -> list[BaseRoute]:
    return [Route("/reload", reload_endpoint, methods=["POST"])]
