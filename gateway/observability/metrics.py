"""Prometheus metrics for generation requests, fed from finished :class:`RequestRecord`\\ s.

Each app owns its own :class:`CollectorRegistry` (tests run several apps in one process).
With several worker processes (``--workers N``) prometheus-client runs in multiprocess
mode: ``PROMETHEUS_MULTIPROC_DIR`` is set before the workers import it, every worker
writes its values to files there, and ``/metrics`` aggregates them with
:class:`MultiProcessCollector`, whichever worker answers the scrape.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

if TYPE_CHECKING:
    from gateway.record import RequestRecord
    from gateway.settings import LiveSettings

PREFIX = "codebuddy2api_"
PROTOCOLS = ("chat", "messages", "responses")
MODES = ("compatible", "realtime")
OUTCOMES = ("success", "error", "cancelled", "invalid", "refused")
#: Error codes meaning the upstream's terminal failed the gateway's validation.
TERMINAL_VALIDATION_CODES = frozenset(
    {"tool_call_invalid", "upstream_incomplete", "tool_identity_changed", "empty_response"}
)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Upstream error codes -> the HTTP status class they come from (when the attempt lacks a status).
_CODE_STATUS_CLASS = {
    "upstream_rate_limited": "4xx",
    "upstream_rejected": "4xx",
    "upstream_not_found": "4xx",
    "upstream_auth_failed": "4xx",
    "upstream_unavailable": "5xx",
    "upstream_error": "5xx",
    "upstream_timeout": "timeout",
    "upstream_unreachable": "network",
}


def multiprocess_mode() -> bool:
    """True when prometheus-client writes to a shared directory (several workers)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def attempt_labels(attempt: dict[str, Any], request_outcome: str) -> tuple[str, str]:
    """(outcome, status_class) of one upstream attempt as recorded by the relay/pool."""
    status = attempt.get("status")
    error = attempt.get("error")
    if isinstance(status, int) and status > 0:
        status_class = f"{status // 100}xx"
    elif error:
        status_class = _CODE_STATUS_CLASS.get(str(error), "none")
    else:
        status_class = "none"
    if error:
        outcome = "error"
    elif request_outcome == "cancelled":
        outcome = "cancelled"  # the client left while this attempt ran
    elif status_class == "none":
        outcome = "unknown"
    else:
        outcome = "success"
    return outcome, status_class


class Metrics:
    """Every gateway metric, registered in one per-app registry."""

    def __init__(self) -> None:
        self.multiprocess = multiprocess_mode()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX
        self.requests = Counter(
            p + "requests", "Generation requests finished", ["protocol", "mode", "streamed", "outcome"], registry=r
        )
        self.duration = Histogram(
            p + "request_duration_seconds", "Generation request duration, start to last byte",
            ["protocol", "mode"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttfb = Histogram(
            p + "time_to_first_byte_seconds", "Streamed requests: start to the first byte sent to the client",
            ["protocol", "mode"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            p + "in_flight_requests", "Generation requests running now", ["protocol"],
            registry=r, multiprocess_mode="livesum",
        )
        self.upstream_attempts = Counter(
            p + "upstream_attempts", "Upstream attempts by outcome and HTTP status class",
            ["outcome", "status_class"], registry=r,
        )
        self.tool_repairs = Counter(p + "tool_repairs", "Tool-call repair attempts", ["outcome"], registry=r)
        self.budget_overflows = Counter(
            p + "budget_overflows", "Requests ended because the output-byte budget was exceeded", registry=r
        )
        self.keepalives = Counter(p + "keepalives_sent", "Keepalive events sent to clients", ["protocol"], registry=r)
        self.terminal_failures = Counter(
            p + "terminal_validation_failures", "Upstream answers refused at the terminal", ["reason"], registry=r
        )
        self.output_bytes = Counter(
            p + "relayed_output_bytes", "Output bytes (text, reasoning, tool arguments) relayed", ["protocol"],
            registry=r,
        )
        self.audit_queue_depth = Gauge(
            p + "audit_queue_depth", "Audit records waiting to be written", registry=r, multiprocess_mode="livesum"
        )
        self.audit_dropped = Counter(
            p + "audit_dropped", "Audit records dropped because the queue was full", registry=r
        )
        self.audit_write_errors = Counter(
            p + "audit_write_errors", "Audit records lost: neither the store nor the spill journal took them",
            registry=r,
        )
        self.config_revision = Gauge(
            p + "config_revision", "Revision of the saved settings in force", registry=r, multiprocess_mode="livemax"
        )
        self.stream_mode = Gauge(
            p + "stream_mode", "1 for the stream mode in force for new requests", ["mode"],
            registry=r, multiprocess_mode="livemax",
        )
        # durability: rows the store could not take (gateway/store/spill.py)
        self.records_spilled = Counter(
            p + "records_spilled", "Rows written to the spill journal because the store failed", ["kind"], registry=r
        )
        self.records_replayed = Counter(
            p + "records_replayed", "Spilled rows replayed into the store after it recovered", ["kind"], registry=r
        )
        self.records_lost = Counter(
            p + "records_lost", "Rows lost: the store and the spill journal both failed", ["kind"], registry=r
        )
        self.store_writable = Gauge(
            p + "store_writable", "1 while the store takes writes", registry=r, multiprocess_mode="livemin"
        )
        self.spill_entries = Gauge(
            p + "spill_entries", "Rows in the spill journal waiting for the store", registry=r,
            multiprocess_mode="livesum",
        )
        self.shutdown_cut = Counter(
            p + "shutdown_cut_requests", "Requests ended by the shutdown deadline", registry=r
        )
        for protocol in PROTOCOLS:
            self.in_flight.labels(protocol)
        for kind in ("audit", "response"):
            for counter in (self.records_spilled, self.records_replayed, self.records_lost):
                counter.labels(kind)

    # -- request events ----------------------------------------------------------------

    def on_start(self, record: RequestRecord) -> None:
        self.in_flight.labels(record.protocol).inc()

    def on_finish(self, record: RequestRecord) -> None:
        protocol, mode = record.protocol, record.mode
        self.in_flight.labels(protocol).dec()
        self.requests.labels(protocol, mode, "true" if record.streamed else "false", record.outcome).inc()
        self.duration.labels(protocol, mode).observe(max(0.0, record.duration_ms) / 1000)
        if record.ttfb_ms is not None:
            self.ttfb.labels(protocol, mode).observe(max(0.0, record.ttfb_ms) / 1000)
        for attempt in record.upstream_attempts:
            self.upstream_attempts.labels(*attempt_labels(attempt, record.outcome)).inc()
        for repair in record.repairs:
            self.tool_repairs.labels(str(repair.get("outcome", "unknown"))).inc()
        if record.budget_exceeded:
            self.budget_overflows.inc()
        if record.keepalives:
            self.keepalives.labels(protocol).inc(record.keepalives)
        if record.error_code in TERMINAL_VALIDATION_CODES:
            self.terminal_failures.labels(record.error_code).inc()
        if record.output_bytes:
            self.output_bytes.labels(protocol).inc(record.output_bytes)

    # -- scrape --------------------------------------------------------------------------

    def refresh(self, live: LiveSettings | None, queue_depth: int) -> None:
        """Set the gauges that mirror state rather than events (called per scrape)."""
        self.audit_queue_depth.set(queue_depth)
        if live is not None:
            current = str(live.current.stream_mode.value)  # first: it picks up a new revision
            self.config_revision.set(live.revision)
            for mode in MODES:
                self.stream_mode.labels(mode).set(1 if mode == current else 0)

    def render(self) -> tuple[bytes, str]:
        """The exposition text: this app's registry, or every worker's files."""
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def process_exit(self) -> None:
        """Multiprocess mode: drop this worker's live gauges (its files stay for counters)."""
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
