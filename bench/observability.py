"""What observability costs, and what TTFT says that TTFB does not (docs/observability.md, "Cost").

- the metrics' per-request bookkeeping (``Metrics.on_start`` + ``on_finish``) and one
  ``/metrics`` render, in isolation;
- the tracing stage (``Tracing.on_finish``, spans to a null exporter) when it is on;
- TTFB and TTFT medians on a slow simulator answer in both stream modes (a real gateway
  in front of the built-in simulator on loopback).

Run alone: ``.venv/bin/python bench/observability.py`` (prints JSON). Not part of ``make test``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

from gateway.generation.record import RequestRecord
from gateway.observability.metrics import Metrics

N = 20000
SLOW = "text;delay=0.1;chunk=16"


def _record(i: int) -> RequestRecord:
    record = RequestRecord(request_id=f"req_{i}", protocol="chat", started_at=time.time(), mode="compatible",
                           model="gpt-x", outcome="success", duration_ms=120.0, ttfb_ms=4.0, streamed=True)
    record.ttft_ms = 100.0
    record.usage = {"prompt_tokens": 50, "completion_tokens": 20, "reasoning_tokens": 5, "cached_tokens": 10}
    record.upstream_attempts = [{"upstream": "upstream", "credential": "abc", "status": 200, "duration_ms": 100.0,
                                 "started_at": record.started_at}]
    return record


def metrics_cost() -> dict[str, Any]:
    metrics = Metrics()
    records = [_record(i) for i in range(N)]
    start = time.perf_counter()
    for record in records:
        metrics.on_start(record)
        metrics.on_finish(record)
    per_request = (time.perf_counter() - start) / N * 1e6
    body, _ = metrics.render()
    start = time.perf_counter()
    for _ in range(50):
        metrics.render()
    return {"on_finish_us": round(per_request, 1), "exposition_bytes": len(body),
            "exposition_lines": body.count(b"\n"), "render_ms": round((time.perf_counter() - start) / 50 * 1000, 2)}


def tracing_cost() -> dict[str, Any]:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from gateway.observability.tracing import Tracing

    class Null(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    tracing = Tracing(BatchSpanProcessor(Null(), max_queue_size=N))
    records = [_record(i) for i in range(5000)]
    start = time.perf_counter()
    for record in records:
        tracing.on_finish(record)
    per_request = (time.perf_counter() - start) / len(records) * 1e6
    tracing.shutdown()
    return {"on_finish_us": round(per_request, 1), "spans_per_request": 2}


async def ttft_vs_ttfb(requests: int = 5) -> dict[str, Any]:
    import httpx

    from gateway.app import create_app
    from gateway.http.servers import bind_loopback, start_embedded, stop_embedded
    from gateway.settings import Settings

    out: dict[str, Any] = {}
    for mode in ("compatible", "realtime"):
        settings = Settings(data_dir=tempfile.mkdtemp(), stream_mode=mode, keepalive_interval=5)
        app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
        sock = bind_loopback()
        server = await start_embedded(app, sock)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                ids = []
                body = {"model": SLOW, "messages": [{"role": "user", "content": "hi"}], "stream": True}
                for _ in range(requests):
                    ids.append((await client.post(url + "/v1/chat/completions", json=body)).headers["x-request-id"])
                rows: list[dict[str, Any]] = []
                while len(rows) < len(ids):
                    await asyncio.sleep(0.1)
                    answers = [await client.get(f"{url}/admin/api/audit/{i}") for i in ids]
                    rows = [a.json() for a in answers if a.status_code == 200]
        finally:
            await stop_embedded(*server)
        out[mode] = {name: round(statistics.median(r[name] for r in rows), 1)
                     for name in ("ttfb_ms", "ttft_ms", "duration_ms")}
    return {"scenario": SLOW, **out}


if __name__ == "__main__":
    from gateway.observability.logging import configure_logging

    configure_logging("warning")
    print(json.dumps({"metrics": metrics_cost(), "tracing": tracing_cost(), "ttft": asyncio.run(ttft_vs_ttfb())},
                     indent=1))
