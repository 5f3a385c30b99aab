"""Admin JSON routes over settings: every value with its source and lock, and revisioned
writes (the WebUI's settings page and stream-mode toggle use these)."""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import BAD_BODY, NotAnObject, admin_error, json_object
from gateway.live_settings import LiveSettings, LockedSetting
from gateway.settings import CLI_FIELDS, Settings, SettingsError
from gateway.store.saved_settings import SECRET_SETTINGS, StaleRevision

#: One line per mode, shown beside the toggle.
MODE_HELP = {
    "compatible": "Collect the whole answer, validate and repair tool calls, then replay it; keepalives while waiting.",
    "realtime": "Relay text and tool calls as they arrive; an invalid ending becomes the protocol's error event.",
}




def _shown(name: str, value: Any) -> Any:
    if name in SECRET_SETTINGS:
        if isinstance(value, list):
            return [f"set ({len(value)})"] if value else []
        return "set" if value else None
    if isinstance(value, SecretStr):
        return "set"
    return value


def settings_view(live: LiveSettings) -> dict[str, Any]:
    current = live.current
    dumped = current.model_dump(mode="json")
    items = {}
    for name, field in Settings.model_fields.items():
        raw = getattr(current, name)
        items[name] = {
            "value": _shown(name, raw if name in SECRET_SETTINGS else dumped[name]),
            "source": live.sources.get(name, "default"),
            "locked": live.locked_reason(name),
            "description": CLI_FIELDS.get(name) or field.description or "",
            "secret": name in SECRET_SETTINGS,
        }
    return {"revision": live.revision, "settings": items, "modes": MODE_HELP}


async def get_settings(request: Request) -> Response:
    return JSONResponse(settings_view(request.app.state.live))


async def put_settings(request: Request) -> Response:
    live: LiveSettings = request.app.state.live
    try:
        payload = await json_object(request)
    except NotAnObject:
        return admin_error(400, *BAD_BODY)
    revision, changes = payload.get("revision"), payload.get("changes")
    unset = payload.get("unset") or []
    if not isinstance(revision, int):
        return admin_error(400, "missing_revision", "name the revision you read: {\"revision\": N, \"changes\": {...}}", "revision")
    if not isinstance(changes, dict) or not isinstance(unset, list):
        return admin_error(400, "invalid_value", "changes must be an object and unset a list", "changes")
    actor = getattr(request.state, "admin_actor", "admin")
    try:
        live.update(changes, revision=revision, actor=actor, unset=tuple(unset))
    except LockedSetting as exc:
        return admin_error(409, "setting_locked", str(exc), exc.name, source=live.sources.get(exc.name))
    except StaleRevision as exc:
        return admin_error(409, "stale_revision", str(exc), "revision", current_revision=exc.current)
    except SettingsError as exc:
        return admin_error(400, "invalid_value", str(exc))
    return JSONResponse(settings_view(live))


async def settings_history(request: Request) -> Response:
    live: LiveSettings = request.app.state.live
    return JSONResponse({"history": live.saved.history() if live.saved is not None else []})


def settings_routes() -> list[BaseRoute]:
    return [
        Route("/settings", get_settings, methods=["GET"]),
        Route("/settings", put_settings, methods=["PUT"]),
        Route("/settings/history", settings_history, methods=["GET"]),
    ]
