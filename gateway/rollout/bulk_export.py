"""The bulk export of rollouts (``GET /admin/api/rollouts/export``), in constant memory.

Rollouts are read in pages of :data:`PAGE_ROLLOUTS`, ordered by (``updated_at``,
``rollout_id``): ``updated_at`` is the last call's end or the last mark (freeze,
incomplete), as the listing says. A *cursor* is that pair for the last rollout written,
so ``cursor=C`` resumes after it; a rollout that changes after it was exported comes again
later with its new ``updated_at``. Each page is one query, each rollout one read of its
calls, marks and labels; building and serialising its lines run in a worker thread, so
the event loop only hands bytes on. Nothing holds more than one page of ids and one
rollout's records.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from gateway.rollout import store as rollout_store
from gateway.rollout.labels import load_labels
from gateway.rollout.shapes import rollout_lines

#: Rollouts per page (one query each).
PAGE_ROLLOUTS = 100
#: Seconds one read of the store may take before the export ends with an error line.
READ_TIMEOUT = 10.0

Cursor = tuple[float, str]
T = TypeVar("T")


def encode_cursor(cursor: Cursor) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([cursor[0], cursor[1]])).decode().rstrip("=")


def decode_cursor(text: str) -> Cursor:
    """A cursor from :func:`encode_cursor`; ValueError for anything else."""
    try:
        value = orjson.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (binascii.Error, orjson.JSONDecodeError, ValueError):
        raise ValueError("not a cursor of this export") from None
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], int | float)
            or isinstance(value[0], bool) or not isinstance(value[1], str)):
        raise ValueError("not a cursor of this export")
    return float(value[0]), value[1]


@dataclass(frozen=True, slots=True)
class ExportQuery:
    """What to export: ``since`` <= updated_at < ``until``, of ``group``, frozen or not
    (None: both), after ``cursor``, in ``shape``; ``exclude_undelivered``: without the
    calls no client is known to have received (gateway/rollout/store.py, "Delivery")."""

    shape: str = "native"
    since: float | None = None
    until: float | None = None
    group: str | None = None
    frozen: bool | None = None
    cursor: Cursor | None = None
    exclude_undelivered: bool = False


def page(conn: Any, query: ExportQuery, after: Cursor | None, limit: int | None = None) -> list[Cursor]:
    """Blocking: the next ``limit`` (a page) rollouts after ``after`` as (updated_at, rollout_id)."""
    where: list[str] = []
    having: list[str] = []
    params: list[Any] = []
    tail: list[Any] = []
    if query.group is not None:
        where.append("u.rollout_id IN (SELECT rollout_id FROM rollout_groups WHERE group_id = ?)")
        params.append(query.group)
    if query.frozen is not None:
        where.append(("" if query.frozen else "NOT ") +
                     "u.rollout_id IN (SELECT rollout_id FROM rollout_marks WHERE kind = 'frozen')")
    if query.since is not None:
        having.append("MAX(u.at) >= ?")
        tail.append(query.since)
    if query.until is not None:
        having.append("MAX(u.at) < ?")
        tail.append(query.until)
    if after is not None:
        having.append("(MAX(u.at) > ? OR (MAX(u.at) = ? AND u.rollout_id > ?))")
        tail += [after[0], after[0], after[1]]
    sql = (
        "SELECT u.rollout_id, MAX(u.at) FROM ("
        "SELECT rollout_id, ended_at AS at FROM rollout_calls UNION ALL SELECT rollout_id, at FROM rollout_marks"
        ") u" + (" WHERE " + " AND ".join(where) if where else "") + " GROUP BY u.rollout_id"
        + (" HAVING " + " AND ".join(having) if having else "") + " ORDER BY MAX(u.at), u.rollout_id LIMIT ?"
    )
    rows = conn.execute(sql, (*params, *tail, limit or PAGE_ROLLOUTS)).fetchall()
    return [(float(at), str(rollout_id)) for rollout_id, at in rows]


def render_records(shape: str, rollout_id: str, updated_at: float, read: tuple[list[dict[str, Any]], list[Any]],
                   labels: dict[str, Any], exclude_undelivered: bool = False) -> list[dict[str, Any]]:
    """One rollout's records in ``shape`` (blocking: the chain is CPU work);
    ``exclude_undelivered``: its calls and segments as if those calls were never made (the
    rollout still says ``complete: false`` and names them in ``undelivered``)."""
    records, marks = read
    snap = rollout_store.snapshot(records, marks, rollout_id, exclude_undelivered)
    segments = rollout_store.trajectory(records, rollout_id, marks, exclude_undelivered)["segments"]
    cursor = encode_cursor((updated_at, rollout_id))
    return rollout_lines(shape, snap, segments, labels, cursor, updated_at)


def render(shape: str, rollout_id: str, updated_at: float, read: tuple[list[dict[str, Any]], list[Any]],
           labels: dict[str, Any], exclude_undelivered: bool = False) -> bytes:
    """One rollout's JSONL lines (blocking: serialising is CPU work too)."""
    return jsonl(render_records(shape, rollout_id, updated_at, read, labels, exclude_undelivered))


def jsonl(records: list[dict[str, Any]]) -> bytes:
    """Records as JSONL lines."""
    return b"".join(orjson.dumps(record) + b"\n" for record in records)


class BulkExport:
    """The I/O shell over one export: ``first_page()`` before the answer's status line (a
    store that does not answer is then a 503), then ``lines()``."""

    def __init__(self, recorder: Any, query: ExportQuery) -> None:
        self.recorder = recorder
        self.db = recorder.db
        self.query = query
        self._first: list[Cursor] | None = None

    async def _page(self, after: Cursor | None) -> list[Cursor]:
        async with asyncio.timeout(READ_TIMEOUT):
            return await self.db.arun(lambda conn: page(conn, self.query, after))

    async def first_page(self) -> None:
        self._first = await self._page(self.query.cursor)

    async def _read(self, rollout_id: str) -> tuple[Any, dict[str, Any]]:
        async with asyncio.timeout(READ_TIMEOUT):
            read = await self.recorder.read(rollout_id)
            labels = await self.db.arun(lambda conn: load_labels(conn, rollout_id))
        return read, labels

    async def _rendered(self, convert: Callable[[list[dict[str, Any]]], T]
                        ) -> AsyncIterator[tuple[Cursor, T | None, bool]]:
        """Each rollout in export order: its cursor, its records (dicts, in ``shape``) passed
        through ``convert`` in the worker thread that renders them (None: deleted since its
        page was read), and whether it ends its page. A store failure raises (TimeoutError or
        one of ``db.errors``); the last cursor yielded is where to resume."""
        rows = self._first or []
        while rows:
            for n, (updated_at, rollout_id) in enumerate(rows):
                read, labels = await self._read(rollout_id)
                out = None if read is None else await asyncio.to_thread(
                    self._convert, convert, rollout_id, updated_at, read, labels)
                yield (updated_at, rollout_id), out, n == len(rows) - 1
            if len(rows) < PAGE_ROLLOUTS:
                return
            rows = await self._page(rows[-1])

    def _convert(self, convert: Callable[[list[dict[str, Any]]], T], rollout_id: str, updated_at: float,
                 read: Any, labels: dict[str, Any]) -> T:
        return convert(render_records(self.query.shape, rollout_id, updated_at, read, labels,
                                      self.query.exclude_undelivered))

    async def record_pages(self, convert: Callable[[list[dict[str, Any]]], T]) -> AsyncIterator[list[T]]:
        """Each page's rollouts, their records through ``convert`` (an export other than JSONL
        turns them into its own form there: :mod:`gateway.rollout.parquet_export`); a store
        failure raises, as such an export has not begun its answer."""
        converted: list[T] = []
        async for _, out, page_end in self._rendered(convert):
            if out is not None:
                converted.append(out)
            if page_end:
                yield converted
                converted = []

    async def lines(self) -> AsyncIterator[bytes]:
        """Each rollout's lines as one chunk; a store failure mid-way ends the export with
        one ``{"error": {...}}`` line carrying the cursor to resume from."""
        after = self.query.cursor
        try:
            async for after, chunk, _ in self._rendered(jsonl):
                if chunk:
                    yield chunk
        except (TimeoutError, *self.db.errors) as exc:
            error = {"code": "store_unavailable", "message": f"the store stopped answering ({type(exc).__name__}); "
                     "resume with the cursor", "cursor": encode_cursor(after) if after else None}
            yield orjson.dumps({"error": error}) + b"\n"
