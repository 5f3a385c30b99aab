"""Admin routes over the managed client keys (gateway/keys/): create (the secret is in
that one answer, never again), list with today's usage, change limits, revoke.

Every write goes to the store first (in a worker thread), then into this replica's
in-memory registry at once; other replicas load it within a second.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import BAD_BODY, NotAnObject, admin_error, json_object
from gateway.keys import store
from gateway.keys.model import (
    PREFIX_CHARS, InvalidField, ManagedKey, hash_secret, limits_from, metadata_of, name_of, new_key_id, new_secret,
)
from gateway.keys.registry import KeyRegistry


def _registry(request: Request) -> KeyRegistry:
    return request.app.state.client_keys


def _invalid(exc: InvalidField) -> Response:
    return admin_error(400, "invalid_value", exc.message, exc.param)


async def _keys(request: Request) -> list[ManagedKey]:
    return await request.app.state.db.acall(store.load_all, request.app.state.db)


def _name_taken(keys: list[ManagedKey], name: str, except_id: str | None = None) -> bool:
    return any(k.name == name and k.revoked_at is None and k.key_id != except_id for k in keys)


async def create_key(request: Request) -> Response:
    try:
        payload = await json_object(request)
    except NotAnObject:
        return admin_error(400, *BAD_BODY)
    try:
        name = name_of(payload.get("name"))
        limits = limits_from(payload)
        metadata = metadata_of(payload.get("metadata"))
    except InvalidField as exc:
        return _invalid(exc)
    if _name_taken(await _keys(request), name):
        return admin_error(409, "key_name_taken", f"a key named {name!r} exists already (names label the metrics)", "name")
    secret = new_secret()
    key = ManagedKey(new_key_id(), name, secret[:PREFIX_CHARS], hash_secret(secret), limits, time.time(), None, metadata)
    await request.app.state.db.acall(store.insert, request.app.state.db, key)
    _registry(request).put(key)
    return JSONResponse({**key.public(), "key": secret}, status_code=201)


async def list_keys(request: Request) -> Response:
    """Every key (revoked ones too), never a secret, with today's usage (UTC day)."""
    db = request.app.state.db
    keys, usage = await asyncio.gather(_keys(request), db.acall(store.usage_today, db))
    zero = {"requests_today": 0, "tokens_today": 0}
    return JSONResponse({"keys": [k.public() | {"usage": usage.get(k.key_id, zero)} for k in keys]})


async def change_key(request: Request) -> Response:
    """Change a key's name, limits, models, expiry or metadata (only the fields sent)."""
    key_id = request.path_params["key_id"]
    try:
        payload = await json_object(request)
    except NotAnObject:
        return admin_error(400, *BAD_BODY)
    keys = await _keys(request)
    key = next((k for k in keys if k.key_id == key_id), None)
    if key is None:
        return admin_error(404, "key_not_found", f"no key {key_id!r}", "key_id")
    try:
        name = name_of(payload["name"]) if "name" in payload else key.name
        limits = limits_from({k: v for k, v in payload.items() if k not in ("name", "metadata")}, key.limits)
        metadata = metadata_of(payload["metadata"]) if "metadata" in payload else key.metadata
    except InvalidField as exc:
        return _invalid(exc)
    if _name_taken(keys, name, except_id=key_id):
        return admin_error(409, "key_name_taken", f"a key named {name!r} exists already", "name")
    changed = ManagedKey(key.key_id, name, key.prefix, key.secret_hash, limits, key.created_at, key.revoked_at, metadata)
    await request.app.state.db.acall(store.update, request.app.state.db, changed)
    _registry(request).put(changed)
    return JSONResponse(changed.public())


async def revoke_key(request: Request) -> Response:
    """Revoke a key: refused at once here, on every replica within two seconds."""
    key_id = request.path_params["key_id"]
    db = request.app.state.db
    if not await db.acall(store.revoke, db, key_id):
        return admin_error(404, "key_not_found", f"no key {key_id!r}", "key_id")
    revoked = next((k for k in await _keys(request) if k.key_id == key_id), None)
    if revoked is not None:
        _registry(request).put(revoked)
    return Response(status_code=204)


def key_routes() -> list[BaseRoute]:
    return [
        Route("/keys", list_keys, methods=["GET"]),
        Route("/keys", create_key, methods=["POST"]),
        Route("/keys/{key_id}", change_key, methods=["PATCH"]),
        Route("/keys/{key_id}", revoke_key, methods=["DELETE"]),
    ]


__all__: list[Any] = ["key_routes"]
