"""OpenTelemetry traces of generation requests, following the GenAI semantic conventions.

Opt-in (``--otlp-endpoint``): this module, and the OpenTelemetry SDK, are imported only
then, so a gateway without it pays nothing. Like the audit row, the metrics and the log
line, the spans are built from the finished :class:`RequestRecord` (one source of truth,
no tracing calls on the streaming path), with the real start and end times it carries:

- ``chat {model}`` (SERVER), one per request: ``gen_ai.operation.name``,
  ``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.usage.input_tokens`` /
  ``output_tokens``, ``gen_ai.response.finish_reasons``, the stream mode and protocol,
  the request id; events ``first_byte`` and ``first_token`` at TTFB and TTFT; status
  ERROR with ``error.type`` = the error code when it failed;
- ``chat {upstream model}`` (CLIENT), one per upstream attempt (failovers and
  regenerations included): upstream, credential fingerprint, HTTP status, error;
- ``repair {kind}`` (INTERNAL), one per tool-call repair step;
- ``keepalive_wait`` (INTERNAL): from the first keepalive to the first content.

A client's W3C ``traceparent`` makes the request span a child of the client's span.
The ids are chosen when the request starts (:meth:`Tracing.on_start`), so each upstream
attempt can send its own span's ``traceparent`` to the upstream (vLLM and SGLang continue
the trace); :class:`_ChosenIds` hands them to the SDK when the spans are built at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.observability.metric_labels import build_version

if TYPE_CHECKING:
    from gateway.generation.record import RequestRecord

OPERATION = "chat"  # all three client protocols are chat-style generations
PROVIDER = "openai"  # the upstream speaks OpenAI Chat Completions
_PROPAGATOR = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for a collector base URL (``/v1/traces`` appended unless given)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if urlsplit(endpoint).path.endswith("/v1/traces") else endpoint + "/v1/traces"


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


class _ChosenIds(IdGenerator):
    """The SDK's id source: the ids chosen for the next span when there are some (set just
    before ``start_span``, on the one thread that builds spans), random ones otherwise."""

    def __init__(self) -> None:
        self.random = RandomIdGenerator()
        self.trace_id: int | None = None
        self.span_id: int | None = None

    def generate_trace_id(self) -> int:
        chosen, self.trace_id = self.trace_id, None
        return chosen if chosen is not None else self.random.generate_trace_id()

    def generate_span_id(self) -> int:
        chosen, self.span_id = self.span_id, None
        return chosen if chosen is not None else self.random.generate_span_id()


class Tracing:
    """A tracer provider of its own (not the global one: tests run several apps) that
    turns each finished record into its spans."""

    def __init__(self, processor: SpanProcessor, instance: str | None = None) -> None:
        attributes = {"service.name": "codebuddy2api", "service.version": build_version()}
        if instance:
            attributes["service.instance.id"] = instance
        self.ids = _ChosenIds()
        self.provider = TracerProvider(resource=Resource.create(attributes), id_generator=self.ids)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("codebuddy2api", build_version())

    @classmethod
    def to_endpoint(cls, endpoint: str, instance: str | None = None) -> Tracing:
        """Batched export over OTLP/HTTP protobuf (a background thread of the SDK)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))), instance)

    def on_start(self, record: RequestRecord) -> None:
        """Choose the request span's ids: the client's trace (and sampling flag) when it
        sent a valid ``traceparent``, else a new trace."""
        trace_id, flags = self.ids.random.generate_trace_id(), "01"
        if record.traceparent:
            context = get_current_span(_PROPAGATOR.extract({"traceparent": record.traceparent})).get_span_context()
            if context.is_valid:
                trace_id, flags = context.trace_id, format(int(context.trace_flags), "02x")
        span_id = self.ids.random.generate_span_id()
        record.trace_context = f"00-{trace_id:032x}-{span_id:016x}-{flags}"

    def on_finish(self, record: RequestRecord) -> None:
        started = record.started_at
        ended = record.ended_at or started + record.duration_ms / 1000
        parent = _PROPAGATOR.extract({"traceparent": record.traceparent}) if record.traceparent else None
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": record.model,
            "codebuddy2api.request_id": record.request_id,
            "codebuddy2api.protocol": record.protocol,
            "codebuddy2api.stream_mode": record.mode,
            "codebuddy2api.streamed": record.streamed,
            "codebuddy2api.outcome": record.outcome,
            "http.response.status_code": record.http_status,
            "codebuddy2api.keepalives": record.keepalives,
        }
        if record.upstream_model:
            attributes["gen_ai.response.model"] = record.upstream_model
        if record.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [record.finish_reason]
        usage = record.usage
        if usage:
            attributes["gen_ai.usage.input_tokens"] = int(usage.get("prompt_tokens") or 0)
            attributes["gen_ai.usage.output_tokens"] = int(usage.get("completion_tokens") or 0)
        if record.error_code:
            attributes["error.type"] = record.error_code
        chosen: tuple[int | None, int | None] = (None, None)
        if record.trace_context:  # the ids the upstream was told (on_start)
            _, trace_hex, span_hex, _ = record.trace_context.split("-")
            chosen = int(trace_hex, 16), int(span_hex, 16)
        span = self._start(
            chosen, f"{OPERATION} {record.model}".strip(), context=parent, kind=SpanKind.SERVER,
            attributes=attributes, start_time=_ns(started),
        )
        if record.ttfb_ms is not None:
            span.add_event("first_byte", timestamp=_ns(started + record.ttfb_ms / 1000))
        if record.ttft_ms is not None:
            span.add_event("first_token", timestamp=_ns(started + record.ttft_ms / 1000))
        if record.outcome in ("error", "invalid", "refused"):
            span.set_status(Status(StatusCode.ERROR, record.error_code or record.outcome))
        inside = set_span_in_context(span)
        for number, attempt in enumerate(record.upstream_attempts):
            self._attempt(inside, number, attempt, record, started)
        for repair in record.repairs:
            self._repair(inside, repair, started)
        if record.first_keepalive_ms is not None:
            wait_end = record.ttft_ms if record.ttft_ms is not None else record.duration_ms
            child = self.tracer.start_span(
                "keepalive_wait", context=inside, kind=SpanKind.INTERNAL,
                attributes={"codebuddy2api.keepalives": record.keepalives},
                start_time=_ns(started + record.first_keepalive_ms / 1000),
            )
            child.end(end_time=_ns(started + max(wait_end, record.first_keepalive_ms) / 1000))
        span.end(end_time=_ns(ended))

    def _attempt(self, context: Any, number: int, attempt: dict[str, Any], record: RequestRecord, fallback: float) -> None:
        begin = float(attempt.get("started_at") or fallback)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": record.upstream_model,
            "codebuddy2api.attempt": number,
            "codebuddy2api.upstream": str(attempt.get("upstream") or ""),
            "codebuddy2api.credential": str(attempt.get("credential") or ""),
        }
        if attempt.get("routing"):  # why the router chose this replica (docs/routing.md)
            attributes["codebuddy2api.routing"] = str(attempt["routing"])
        if isinstance(attempt.get("status"), int):
            attributes["http.response.status_code"] = attempt["status"]
        if attempt.get("error"):
            attributes["error.type"] = str(attempt["error"])
        chosen = (None, int(str(attempt["span_id"]), 16) if attempt.get("span_id") else None)
        child = self._start(
            chosen, f"{OPERATION} {record.upstream_model}".strip(), context=context, kind=SpanKind.CLIENT,
            attributes=attributes, start_time=_ns(begin),
        )
        if attempt.get("error"):
            child.set_status(Status(StatusCode.ERROR, str(attempt["error"])))
        child.end(end_time=_ns(begin + float(attempt.get("duration_ms") or 0) / 1000))

    def _start(self, chosen: tuple[int | None, int | None], name: str, **kwargs: Any) -> Any:
        """``start_span`` with the chosen (trace id, span id), never leaking them into the next span."""
        self.ids.trace_id, self.ids.span_id = chosen
        try:
            return self.tracer.start_span(name, **kwargs)
        finally:
            self.ids.trace_id = self.ids.span_id = None

    def _repair(self, context: Any, repair: dict[str, Any], fallback: float) -> None:
        begin = float(repair.get("started_at") or fallback)
        kind = str(repair.get("kind") or "unknown")
        attributes: dict[str, Any] = {
            "codebuddy2api.repair.kind": kind,
            "codebuddy2api.repair.attempt": int(repair.get("attempt") or 0),
            "codebuddy2api.repair.outcome": str(repair.get("outcome") or ""),
        }
        usage = repair.get("usage") or {}
        if usage:
            attributes["gen_ai.usage.input_tokens"] = int(usage.get("prompt_tokens") or 0)
            attributes["gen_ai.usage.output_tokens"] = int(usage.get("completion_tokens") or 0)
        child = self.tracer.start_span(
            f"repair {kind}", context=context, kind=SpanKind.INTERNAL, attributes=attributes, start_time=_ns(begin)
        )
        child.end(end_time=_ns(begin + float(repair.get("duration_ms") or 0) / 1000))

    def shutdown(self) -> None:
        """Export what is queued, then stop (blocking: call it off the event loop)."""
        self.provider.shutdown()
