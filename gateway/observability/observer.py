"""The request observer: every finished generation request goes to the audit store,
the Prometheus metrics and one structured log line.

:class:`Observability` bundles the three for an app (built in ``create_app``, started and
drained by its lifespan); :class:`GatewayObserver` is what the relay calls. Observer
failures are logged and swallowed: bookkeeping never breaks a client's request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from gateway.observability.logging import route_uvicorn_logs
from gateway.observability.metrics import Metrics
from gateway.observability.pricing import cost, price_of
from gateway.store.audit import AUDIT_UPSERT, AuditWriter
from gateway.store.db import Database
from gateway.store.responses import RESPONSE_STATEMENTS, SPILL_KINDS
from gateway.store.spill import DurableWriter, SpillJournal
from gateway.upstream.config_file import ModelPrice, model_entries

if TYPE_CHECKING:
    from gateway.generation.record import RequestRecord
    from gateway.live_settings import LiveSettings
    from gateway.observability.tracing import Tracing

log = structlog.get_logger("gateway.request")


def log_request(record: RequestRecord) -> None:
    """One line per request: identifiers, outcome and timings; never a body or a secret."""
    log.info(
        "request",
        request_id=record.request_id,
        protocol=record.protocol,
        mode=record.mode,
        streamed=record.streamed,
        model=record.model,
        outcome=record.outcome,
        error_code=record.error_code,
        status=record.http_status,
        finish_reason=record.finish_reason,
        duration_ms=round(record.duration_ms, 1),
        ttfb_ms=record.ttfb_ms,
        ttft_ms=record.ttft_ms,
        output_bytes=record.output_bytes,
        tool_calls=record.tool_calls,
        keepalives=record.keepalives,
        upstream_attempts=len(record.upstream_attempts),
        key_id=record.key_id,  # the managed client key (its id, never its secret)
        cost=record.cost,
    )


class GatewayObserver:
    """Feeds metrics, the audit queue, the request log and (with ``--otlp-endpoint``)
    the traces; tolerant of a double finish."""

    def __init__(self, metrics: Metrics, audit: AuditWriter,
                 price: Callable[[str], ModelPrice | None] = lambda model: None) -> None:
        self.metrics = metrics
        self.audit = audit
        self.price = price  # the --config price of a client model name (None: unpriced)
        self.tracing: Tracing | None = None
        self._open: set[str] = set()

    def on_start(self, record: RequestRecord) -> None:
        self._open.add(record.request_id)
        try:
            self.metrics.on_start(record)
            if self.tracing is not None:
                self.tracing.on_start(record)
        except Exception:  # pragma: no cover - a metrics bug must not fail the request
            log.exception("observer_failed", stage="start", request_id=record.request_id)

    def on_finish(self, record: RequestRecord) -> None:
        if record.request_id not in self._open:
            log.warning("observer_unexpected_finish", request_id=record.request_id)
            return
        self._open.discard(record.request_id)
        try:  # stamped before anyone reads the record: audit, metrics and log agree
            record.cost = cost(record.usage, self.price(record.model)) if record.usage else None
        except Exception:  # pragma: no cover - a pricing bug must not lose the record
            log.exception("observer_failed", stage="cost", request_id=record.request_id)
        steps = [("metrics", self.metrics.on_finish), ("audit", self.audit.submit), ("log", log_request)]
        if self.tracing is not None:
            steps.append(("trace", self.tracing.on_finish))
        for stage, step in steps:
            try:
                step(record)
            except Exception:  # pragma: no cover
                log.exception("observer_failed", stage=stage, request_id=record.request_id)

    @property
    def in_flight(self) -> int:
        return len(self._open)


class Observability:
    """Metrics + the durable writer (store, else spill journal) + audit writer + observer
    for one app, with their lifecycle."""

    def __init__(
        self, live: LiveSettings, db: Database, flush_interval: float = 0.05, journal: SpillJournal | None = None
    ) -> None:
        self.live = live
        self.metrics = Metrics()
        m = self.metrics
        self.journal = journal
        self.durable = DurableWriter(
            db, journal, {"audit": AUDIT_UPSERT, **RESPONSE_STATEMENTS},
            on_spilled=lambda kind, n: m.records_spilled.labels(SPILL_KINDS.get(kind, kind)).inc(n),
            on_lost=lambda kind, n: m.records_lost.labels(SPILL_KINDS.get(kind, kind)).inc(n),
            on_replayed=lambda kind, n: m.records_replayed.labels(SPILL_KINDS.get(kind, kind)).inc(n),
        )
        self.audit = AuditWriter(
            db,
            retention_days=lambda: float(live.current.audit_retention_days),
            store_bodies=lambda: bool(live.current.audit_bodies),
            body_max_bytes=lambda: int(live.current.audit_body_max_bytes),
            flush_interval=flush_interval,
            on_drop=self.metrics.audit_dropped.inc,
            on_write_error=self.metrics.audit_write_errors.inc,
            durable=self.durable,
        )
        self.observer = GatewayObserver(self.metrics, self.audit,
                                        lambda model: price_of(model, model_entries(live.current.config)))
        endpoint = live.current.otlp_endpoint
        if endpoint:  # the SDK is imported only now: no tracing, no cost
            from gateway.observability.tracing import Tracing

            self.observer.tracing = Tracing.to_endpoint(endpoint, live.current.replica_id)

    @property
    def tracing(self) -> Tracing | None:
        return self.observer.tracing

    async def start(self) -> None:
        route_uvicorn_logs()  # after any embedded server detached uvicorn.access
        await self.durable.start()  # replays what an earlier run spilled
        await self.audit.start()

    async def aclose(self) -> None:
        """Drain the audit queue (before the database closes); what the store still
        cannot take stays in the spill journal for the next start."""
        await self.audit.aclose()
        if self.observer.tracing is not None:  # flushes the last spans (blocking HTTP)
            await asyncio.to_thread(self.observer.tracing.shutdown)
        await self.durable.aclose()
        if self.journal is not None:
            self.journal.close()
        self.metrics.refresh(self.live, 0)
        self.metrics.process_exit()

    def exposition(self) -> tuple[bytes, str]:
        self.metrics.refresh(self.live, self.audit.depth)
        self.metrics.state.update(time.time())
        self.metrics.store_writable.set(1 if self.durable.store_writable else 0)
        self.metrics.spill_reserved.set(1 if self.journal is not None and self.journal.reserved else 0)
        self.metrics.spill_entries.set(self.durable.spill_entries)
        return self.metrics.render()


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: Prometheus text exposition (all workers in multiprocess mode).

    Rendered in a worker thread, never on the event loop: with every known series declared
    the text is ~600 lines (tens of milliseconds of Python), and in multiprocess mode it
    also reads every worker's files. prometheus-client copies each family's children
    under its lock, so requests finishing meanwhile are safe."""
    obs: Observability = request.app.state.observability
    body, content_type = await run_in_threadpool(obs.exposition)
    return Response(body, media_type=content_type)
