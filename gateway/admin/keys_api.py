"""Admin routes over the managed client keys (gateway/keys/): create (the secret is in
that one answer, never again), list with today's usage, usage over any window (from the
audit records), change limits, revoke.

Every write goes to the store first (in a worker thread), then into this replica's
in-memory registry at once; other replicas load it within a second.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.common import BAD_BODY, NotAnObject, admin_error, json_object
from gateway.keys import store, usage_window
from gateway.keys.budget_left import left_of
from gateway.keys.model import (
    PREFIX_CHARS,
    InvalidField,
    KeyLimits,
    ManagedKey,
    hash_secret,
    limits_from,
    metadata_of,
    name_of,
    new_key_id,
    new_secret,
)
from gateway.keys.quota import Counts
from gateway.keys.registry import KeyRegistry
from gateway.store import audit_queries
from gateway.store.replicas import without_managed_keys
from gateway.upstream.config_file import model_entries


def _registry(request: Request) -> KeyRegistry:
    return request.app.state.client_keys


def _invalid(exc: InvalidField) -> Response:
    return admin_error(400, "invalid_value", exc.message, exc.param)


async def _keys(request: Request) -> list[ManagedKey]:
    return await request.app.state.db.acall(store.load_all, request.app.state.db)


def _unpriced(request: Request, limits: KeyLimits) -> Response | None:
    """A money budget needs prices: refused (400 naming ``budget_cost``) when no
    ``[models."<glob>"]`` table of ``--config`` has one, since every request would then be
    refused as unpriced."""
    if limits.budget_cost is None:
        return None
    if any(entry.price is not None for _, entry in model_entries(request.app.state.live.current.config)):
        return None
    return admin_error(400, "invalid_value", "budget_cost needs prices: no [models.\"<glob>\"] table of the gateway's "
                       "--config has a price (a request of a model without one is refused for a key with budget_cost)",
                       "budget_cost")


def _name_taken(keys: list[ManagedKey], name: str, except_id: str | None = None) -> bool:
    return any(k.name == name and k.revoked_at is None and k.key_id != except_id for k in keys)


def _older_replicas(request: Request) -> list[dict[str, Any]]:
    """Live replicas of a version that may serve a managed key's requests without it (one
    without client keys serves everyone): while any is alive, no managed key is created."""
    replication = getattr(request.app.state, "replication", None)
    return [] if replication is None else without_managed_keys(replication.live_members())


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
    older = _older_replicas(request)
    if older:
        named = ", ".join(f"{m.get('host')} pid {m.get('pid')}" for m in older[:5])
        return admin_error(409, "replicas_without_managed_keys",
                           f"{len(older)} live replica(s) of an older version may not enforce managed keys ({named}):"
                           " finish the rolling upgrade, then create keys (docs/operations.md, Upgrades)")
    if (unpriced := _unpriced(request, limits)) is not None:
        return unpriced
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
    budgeted = [k for k in keys if k.revoked_at is None and left_of(k, Counts(0.0))]
    _, counts = await db.acall(store.budget_counts, db, budgeted) if budgeted else (0.0, {})
    zero = {"requests_today": 0, "tokens_today": 0}

    def shown(key: ManagedKey) -> dict[str, Any]:
        out = key.public() | {"usage": usage.get(key.key_id, zero)}
        if key.key_id in counts:  # what is left of each budget now (settled plus held)
            left = left_of(key, counts[key.key_id])
            out["budget_left"] = {"daily_tokens": left.get("daily_tokens"), "tokens": left.get("budget_tokens"),
                                  "cost": left.get("budget_cost")}
        return out

    return JSONResponse({"keys": [shown(k) for k in keys]})


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
    if limits.budget_cost != key.limits.budget_cost and (unpriced := _unpriced(request, limits)) is not None:
        return unpriced
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


async def key_usage(request: Request) -> Response:
    """A key's requests, tokens and cost over ``since``..``until`` (default: the last 30
    days), in total and ``by=day``; revoked keys too (their history stays)."""
    key_id = request.path_params["key_id"]
    if _registry(request).get(key_id) is None and not any(k.key_id == key_id for k in await _keys(request)):
        return admin_error(404, "key_not_found", f"no key {key_id!r}", "key_id")
    params = request.query_params
    unknown = sorted(set(params) - {"since", "until", "by"})
    if unknown:
        return admin_error(400, "invalid_parameter", f"unknown parameter {unknown[0]!r} (allowed: since, until, by)", unknown[0])
    by = params.get("by") or "total"
    if by not in usage_window.GROUPINGS:
        return admin_error(400, "invalid_parameter", "by must be day or total", "by")
    try:
        until = _when(params.get("until"), "until") or time.time()
        since = _when(params.get("since"), "since") or until - usage_window.DEFAULT_WINDOW
    except InvalidField as exc:
        return admin_error(400, "invalid_parameter", exc.message, exc.param)
    if not 0 < until - since <= usage_window.MAX_WINDOW:
        return admin_error(400, "invalid_parameter", "since must be before until, at most 366 days apart", "since")
    rows = await audit_queries.key_usage_rows(request.app.state.db, key_id, since, until)
    return JSONResponse({"id": key_id, **usage_window.summarise(rows, since, until, by)})


def _when(raw: str | None, param: str) -> float | None:
    """Unix seconds or an RFC 3339 time (None: not given)."""
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        at = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidField(param, f"{param} must be Unix seconds or an RFC 3339 time, got {raw!r}") from None
    if at.tzinfo is None:
        raise InvalidField(param, f"{param} must carry a time zone (e.g. 2026-01-01T00:00:00Z)")
    return at.timestamp()


def key_routes() -> list[BaseRoute]:
    return [
        Route("/keys", list_keys, methods=["GET"]),
        Route("/keys/{key_id}/usage", key_usage, methods=["GET"]),
        Route("/keys", create_key, methods=["POST"]),
        Route("/keys/{key_id}", change_key, methods=["PATCH"]),
        Route("/keys/{key_id}", revoke_key, methods=["DELETE"]),
    ]


__all__: list[Any] = ["key_routes"]
