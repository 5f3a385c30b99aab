"""Admin routes over the envelope keyring (gateway/store/envelope_keys.py): list the keys
(numbers and times, never a secret) and rotate to a new one."""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import BAD_BODY, NotAnObject, admin_error, json_object
from gateway.store.envelope_keys import ACTIVATION_DELAY

#: The longest ``activate_in`` a rotation accepts (a day).
MAX_ACTIVATE_IN = 86400.0


async def list_keys(request: Request) -> Response:
    return JSONResponse({"keys": request.app.state.envelope_keys.status()})


async def rotate(request: Request) -> Response:
    """``{"activate_in": seconds}`` (default: two refresh intervals, so every replica has
    loaded the key before any seals with it; 0 for a single process)."""
    try:
        body = await json_object(request)
    except NotAnObject:
        return admin_error(400, *BAD_BODY)
    activate_in = body.get("activate_in", ACTIVATION_DELAY)
    if (
        isinstance(activate_in, bool)
        or not isinstance(activate_in, (int, float))
        or not math.isfinite(activate_in)
        or not 0 <= activate_in <= MAX_ACTIVATE_IN
    ):
        return admin_error(400, "invalid_value", f"activate_in must be a number of seconds from 0 to {MAX_ACTIVATE_IN:g}", "activate_in")
    keys = request.app.state.envelope_keys
    key = await keys.rotate(float(activate_in))
    return JSONResponse({"rotated": key.number, "active_from": key.active_from, "keys": keys.status()})


def envelope_key_routes() -> list[BaseRoute]:
    return [
        Route("/envelope-keys", list_keys, methods=["GET"]),
        Route("/envelope-keys/rotate", rotate, methods=["POST"]),
    ]
