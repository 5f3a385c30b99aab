"""``GET /admin/api/rollouts/export``: every rollout that matches, streamed as JSONL (or one
Parquet file) in the shape a trainer loads (docs/capture.md "Bulk export";
:mod:`gateway.rollout.bulk_export`, :mod:`gateway.rollout.parquet_export`)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from gateway.admin.audit_api import BadParam, _bad, _time
from gateway.admin.common import admin_error
from gateway.admin.rollouts_api import _recorder
from gateway.rollout import parquet_export
from gateway.rollout.bulk_export import BulkExport, ExportQuery, decode_cursor
from gateway.rollout.labels import BadLabel, check_group
from gateway.rollout.shapes import SHAPES

PARQUET_TYPE = "application/vnd.apache.parquet"
FORMATS = ("jsonl", "parquet")
_BOOLEAN = {"true": True, "1": True, "false": False, "0": False}


def _query(request: Request) -> tuple[ExportQuery, str]:
    """The export's query and its format (``jsonl`` or ``parquet``), or ``BadParam``."""
    params = request.query_params
    shape = params.get("shape") or "native"
    if shape not in SHAPES:
        raise BadParam("shape", f"shape must be one of {', '.join(SHAPES)}")
    file_format = params.get("format") or "jsonl"
    if file_format not in FORMATS:
        raise BadParam("format", f"format must be one of {', '.join(FORMATS)}")
    frozen_text = params.get("frozen")
    if frozen_text not in (None, "") and frozen_text not in _BOOLEAN:
        raise BadParam("frozen", "frozen must be true or false")
    group = params.get("group") or None
    if group is not None:
        try:
            check_group(group, "group")
        except BadLabel as err:
            raise BadParam("group", str(err)) from None
    undelivered = params.get("undelivered") or "include"
    if undelivered not in ("include", "exclude"):
        raise BadParam("undelivered", "undelivered must be include or exclude")
    cursor_text = params.get("cursor") or None
    try:
        cursor = decode_cursor(cursor_text) if cursor_text else None
    except ValueError as err:
        raise BadParam("cursor", f"cursor: {err}") from None
    query = ExportQuery(shape=shape, since=_time(request, "since"), until=_time(request, "until"), group=group,
                        frozen=_BOOLEAN.get(frozen_text or ""), cursor=cursor,
                        exclude_undelivered=undelivered == "exclude")
    return query, file_format


async def export(request: Request) -> Response:
    try:
        query, file_format = _query(request)
    except BadParam as err:
        return _bad(err)
    parquet = file_format == "parquet"
    if parquet:
        try:
            await asyncio.to_thread(parquet_export.load_pyarrow)  # the first import takes ~0.15 s
        except parquet_export.ParquetUnavailable as err:
            return admin_error(400, "parquet_unavailable", str(err), param="format")
    recorder = _recorder(request)
    bulk = BulkExport(recorder, query)
    try:
        await bulk.first_page()
        if not parquet:
            return StreamingResponse(bulk.lines(), media_type="application/x-ndjson")
        out = await parquet_export.build(bulk)
    except (TimeoutError, *recorder.db.errors):
        return admin_error(503, "store_unavailable", "the store did not answer; try again")
    filename = f"rollouts-{query.shape}.parquet"
    return StreamingResponse(parquet_export.chunks(out), media_type=PARQUET_TYPE,
                             headers={"content-disposition": f'attachment; filename="{filename}"'})


def rollout_export_routes() -> list[BaseRoute]:
    """Mounted before ``/rollouts/{rollout_id}`` (which would take ``export`` as an id)."""
    return [Route("/rollouts/export", export, methods=["GET"])]
