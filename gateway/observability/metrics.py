"""Prometheus metrics for generation requests, fed from finished :class:`RequestRecord`\\ s.

Each app owns its own :class:`CollectorRegistry` (tests run several apps in one process).
Label values that come from traffic (model names, upstream names, error codes) go through a
:class:`BoundedLabel`: configured values and a bounded set of the most frequent others keep
their name, the rest become ``other``, so no client can grow the series without bound.
Known label combinations are declared at zero at start, so a scraper sees them before the
first event.

With several worker processes (``--workers N``) prometheus-client runs in multiprocess
mode: ``PROMETHEUS_MULTIPROC_DIR`` is set before the workers import it, every worker
writes its values to files there, and ``/metrics`` aggregates them with
:class:`MultiProcessCollector`, whichever worker answers the scrape.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)

from gateway.observability.metric_labels import (
    ATTEMPT_OUTCOMES,
    DYNAMIC_ERROR_CODES,
    DYNAMIC_MODELS,
    DYNAMIC_UPSTREAMS,
    KNOWN_ERROR_CODES,
    LATENCY_BUCKETS,
    MODES,
    OTHER,
    OUTCOMES,
    PREFIX,
    PROTOCOLS,
    REPAIR_OUTCOMES,
    STATUS_CLASSES,
    TERMINAL_VALIDATION_CODES,
    TOKEN_KINDS,
    BoundedLabel,
    WorkersProcessCollector,
    attempt_labels,
    build_version,
    multiprocess_mode,
)
from gateway.observability.state_gauges import StateGauges
from gateway.upstream.routing import REASONS as ROUTING_REASONS

if TYPE_CHECKING:
    from gateway.generation.record import RequestRecord
    from gateway.live_settings import LiveSettings
    from gateway.upstream.pool import UpstreamPool

#: No ``*_created`` samples: with every known series declared they would double the
#: exposition and the series Prometheus stores, for a timestamp no dashboard reads
#: (``rate()`` handles counter resets without it).
disable_created_metrics()  # type: ignore[no-untyped-call]

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
            ["protocol", "mode"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttfb = Histogram(
            p + "time_to_first_byte_seconds", "Streamed requests: start to the first byte sent to the client",
            ["protocol", "mode"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Streamed requests: start to the first content (text, reasoning or tool arguments) sent to the client",
            ["protocol", "mode"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.tokens = Counter(
            p + "tokens", "Tokens reported by the upstream for finished answers (input, output, reasoning, cached)",
            ["protocol", "mode", "model", "upstream", "kind"], registry=r,
        )
        # managed client keys (gateway/keys/): the key label is a managed key's name, or
        # `other` (static --api-key keys, no key): bounded by the keys an admin created
        self.key_requests = Counter(
            p + "key_requests", "Generation requests finished, by managed client key",
            ["key", "protocol", "outcome"], registry=r,
        )
        self.key_tokens = Counter(
            p + "key_tokens", "Tokens used by finished answers, by managed client key (input, output)",
            ["key", "kind"], registry=r,
        )
        self.cost = Counter(
            p + "cost", "What finished answers cost, priced by the --config model tables (per-million prices)",
            ["model", "key"], registry=r,
        )
        self.key_names: set[str] = set()
        self.state = StateGauges(r, p)  # credentials by state, live replicas, this replica's share
        self.request_errors = Counter(
            p + "request_errors", "Generation requests that ended with an error code, by code",
            ["protocol", "mode", "error_code"], registry=r,
        )
        self.in_flight = Gauge(
            p + "in_flight_requests", "Generation requests running now", ["protocol"],
            registry=r, multiprocess_mode="livesum",
        )
        self.upstream_attempts = Counter(
            p + "upstream_attempts", "Upstream attempts by upstream, outcome and HTTP status class",
            ["upstream", "outcome", "status_class"], registry=r,
        )
        self.routing_decisions = Counter(
            p + "routing_decisions", "Replica choices for upstream attempts, by the router's reason", ["reason"], registry=r,
        )
        self.upstream_in_flight = Gauge(
            p + "upstream_calls_in_flight", "Upstream attempts running now, by upstream (replica)", ["upstream"],
            registry=r, multiprocess_mode="livesum",
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
            p + "audit_dropped", "Audit records dropped: queue and spill overflow both full (or no spill journal), or submitted after shutdown", registry=r
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
        self.unrecordable_requests = Counter(
            p + "unrecordable_requests", "Generation requests that came while no record could be kept"
            " (gateway/generation/recording_gate.py): refused (503 recording_unavailable) or served (--serve-unrecorded)",
            ["action"], registry=r,
        )
        for action in ("refused", "served"):
            self.unrecordable_requests.labels(action)
        self.spill_reserved = Gauge(
            p + "spill_reserved", "1 while the spill journal's space is reserved on disk", registry=r,
            multiprocess_mode="livemin",
        )
        self.capture_records = Counter(
            p + "capture_records", "Model-call capture records (--capture-dir) by outcome: written, dropped"
            " (the queue was full), lost (the disk failed longer than the in-memory hold lasted)", ["outcome"],
            registry=r,
        )
        for outcome in ("written", "dropped", "lost"):
            self.capture_records.labels(outcome)
        self.shutdown_cut = Counter(
            p + "shutdown_cut_requests", "Requests ended by the shutdown deadline", registry=r
        )
        # Responses over WebSocket (gateway/protocols/responses/websocket_slots.py: ConnectionSlots)
        self.key_budget_left = Gauge(
            p + "key_budget_left", "What is left of a managed key's budget now (tokens; budget_cost: money), by "
            "key name and budget (daily_tokens, budget_tokens, budget_cost)", ["key", "budget"],
            registry=r, multiprocess_mode="livemin",
        )
        self.websockets_open = Gauge(
            p + "websockets_open", "Responses WebSocket connections open now (--ws-max-connections per process)",
            registry=r, multiprocess_mode="livesum",
        )
        self.websocket_upgrades_refused = Counter(
            p + "websocket_upgrades_refused", "Responses WebSocket upgrades refused: --ws-max-connections were open",
            registry=r,
        )
        for kind in ("audit", "response", "key_settle", "key_count"):
            for counter in (self.records_spilled, self.records_replayed, self.records_lost):
                counter.labels(kind)
        # gateway/observability/loop_lag.py and gateway/upstream/connections.py (issue #31)
        self.event_loop_lag = Gauge(
            p + "event_loop_lag_seconds", "How late the event loop ran its last sample (every 0.25 s)",
            registry=r, multiprocess_mode="livemax",
        )
        self.asyncio_tasks = Gauge(
            p + "asyncio_tasks", "asyncio tasks on the event loop at the last sample", registry=r,
            multiprocess_mode="livesum",
        )
        self.upstream_connections = Gauge(
            p + "upstream_connections_in_use", "Upstream responses open now (each holds a pool connection)",
            registry=r, multiprocess_mode="livesum",
        )
        self.upstream_pool_timeouts = Counter(
            p + "upstream_pool_timeouts", "Requests that found no free upstream connection in --upstream-pool-timeout",
            registry=r,
        )
        # weight sync (gateway/engines/): engines paused through the admin API, calls held meanwhile
        self.engine_paused = Gauge(
            p + "engine_paused", "1 while an engine is paused for a weight update (through the admin API)",
            ["upstream"], registry=r, multiprocess_mode="livemax",
        )
        self.engine_held_calls = Gauge(
            p + "engine_held_calls", "Generation calls waiting in the gateway while the engines are paused",
            registry=r, multiprocess_mode="livesum",
        )
        self.continuations = Counter(
            p + "continuations", "Chat answers an engine ended with finish_reason abort, continued with the"
            " partial answer as a prefill", ["reason"], registry=r,
        )
        self.continuations.labels("abort")
        self.build_info = Gauge(
            p + "build_info", "Always 1: the gateway's version and Python", ["version", "python"],
            registry=r, multiprocess_mode="livemax",
        )
        self.build_info.labels(build_version(), platform.python_version()).set(1)
        if not self.multiprocess:
            ProcessCollector(registry=r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.models = BoundedLabel(capacity=DYNAMIC_MODELS)
        self.upstreams = BoundedLabel(capacity=DYNAMIC_UPSTREAMS)
        self.error_codes = BoundedLabel(KNOWN_ERROR_CODES, capacity=DYNAMIC_ERROR_CODES, min_hits=1)
        self._declare()

    def _declare(self) -> None:
        """Every series of the known label values, at zero (idempotent)."""
        for protocol in PROTOCOLS:
            self.in_flight.labels(protocol)
            self.keepalives.labels(protocol)
            self.output_bytes.labels(protocol)
            for mode in MODES:
                for streamed in ("true", "false"):
                    for outcome in OUTCOMES:
                        self.requests.labels(protocol, mode, streamed, outcome)
                self.duration.labels(protocol, mode)
                self.ttfb.labels(protocol, mode)
                self.ttft.labels(protocol, mode)
                for code in self.error_codes.known:
                    self.request_errors.labels(protocol, mode, code)
                for model in self.models.known:
                    for upstream in self.upstreams.known:
                        for kind in TOKEN_KINDS:
                            self.tokens.labels(protocol, mode, model, upstream, kind)
        for reason in ROUTING_REASONS:
            self.routing_decisions.labels(reason)
        for upstream in self.upstreams.known:
            self.upstream_in_flight.labels(upstream)
            for outcome in ATTEMPT_OUTCOMES:
                for status_class in STATUS_CLASSES:
                    self.upstream_attempts.labels(upstream, outcome, status_class)
        for outcome in REPAIR_OUTCOMES:
            self.tool_repairs.labels(outcome)
        for reason in TERMINAL_VALIDATION_CODES:
            self.terminal_failures.labels(reason)

    def declare_configuration(self, pool: UpstreamPool) -> None:
        """Learn the configured models (allow-lists, model maps) and upstream names, and
        declare their series at zero."""
        for credential in pool.credentials:
            upstream = credential.upstream
            self.upstreams.add_known([upstream.name])
            self.models.add_known([*(upstream.models or ()), *upstream.model_map])
            if upstream.engine_api is not None:
                self.engine_paused.labels(upstream.name)
        self._declare()

    def declare_keys(self, keys: Iterable[Any]) -> None:
        """The managed keys' names (label values; a revoked key keeps its series)."""
        self.key_names.update(k.name for k in keys)

    def key_label(self, record: RequestRecord) -> str:
        return record.key_name if record.key_id and record.key_name in self.key_names else OTHER

    def lease_changed(self, credential: Any, delta: int) -> None:
        """The pool's ``on_lease``: an upstream attempt started (+1) or ended (-1)."""
        self._child(self.upstream_in_flight, self.upstreams(credential.upstream.name)).inc(delta)

    # -- request events ----------------------------------------------------------------

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered (the values are bounded; ``labels()``
        validates and locks on every call and was most of the per-request cost)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def on_start(self, record: RequestRecord) -> None:
        self._child(self.in_flight, record.protocol).inc()

    def on_finish(self, record: RequestRecord) -> None:
        child = self._child
        protocol, mode = record.protocol, record.mode
        child(self.in_flight, protocol).dec()
        child(self.requests, protocol, mode, "true" if record.streamed else "false", record.outcome).inc()
        key = self.key_label(record)
        child(self.key_requests, key, protocol, record.outcome).inc()
        for kind in ("input", "output"):
            count = (record.usage or {}).get(TOKEN_KINDS[kind]) or 0
            if count > 0:
                child(self.key_tokens, key, kind).inc(count)
        child(self.duration, protocol, mode).observe(max(0.0, record.duration_ms) / 1000)
        if record.ttfb_ms is not None:
            child(self.ttfb, protocol, mode).observe(max(0.0, record.ttfb_ms) / 1000)
        if record.ttft_ms is not None:
            child(self.ttft, protocol, mode).observe(max(0.0, record.ttft_ms) / 1000)
        if record.error_code:
            child(self.request_errors, protocol, mode, self.error_codes(record.error_code)).inc()
        for attempt in record.upstream_attempts:
            upstream = self.upstreams(str(attempt.get("upstream") or ""))
            child(self.upstream_attempts, upstream, *attempt_labels(attempt, record.outcome)).inc()
            if attempt.get("routing") in ROUTING_REASONS:
                child(self.routing_decisions, attempt["routing"]).inc()
        if record.usage:
            answered = record.upstream_attempts[-1].get("upstream") if record.upstream_attempts else None
            model, upstream = self.models(record.model), self.upstreams(str(answered or ""))
            for kind, field in TOKEN_KINDS.items():
                count = record.usage.get(field) or 0
                if count > 0:
                    child(self.tokens, protocol, mode, model, upstream, kind).inc(count)
        if record.cost:
            child(self.cost, self.models(record.model), key).inc(record.cost)
        for repair in record.repairs:
            child(self.tool_repairs, str(repair.get("outcome", "unknown"))).inc()
        if record.budget_exceeded:
            self.budget_overflows.inc()
        if record.keepalives:
            child(self.keepalives, protocol).inc(record.keepalives)
        if record.error_code in TERMINAL_VALIDATION_CODES:
            child(self.terminal_failures, record.error_code).inc()
        if record.output_bytes:
            child(self.output_bytes, protocol).inc(record.output_bytes)

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
            registry.register(WorkersProcessCollector(os.environ["PROMETHEUS_MULTIPROC_DIR"]))  # type: ignore[arg-type]
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def process_exit(self) -> None:
        """Multiprocess mode: drop this worker's live gauges (its files stay for counters)."""
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]
