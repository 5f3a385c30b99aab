"""The vocabulary of the gateway's metrics: label values and their bounds, the name
prefix, the worker-process collector and the build label. Apart from
:mod:`gateway.observability.metrics` (the families and what feeds them), so the families
read as a list and these rules can be tested on their own."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric

from gateway.errors import ErrorCode

PREFIX = "codebuddy2api_"
PROTOCOLS = ("chat", "messages", "responses")
MODES = ("compatible", "realtime")
OUTCOMES = ("success", "error", "cancelled", "invalid", "refused")
ATTEMPT_OUTCOMES = ("success", "error", "cancelled", "unknown")
STATUS_CLASSES = ("2xx", "4xx", "5xx", "timeout", "network", "none")
REPAIR_OUTCOMES = ("valid", "repaired", "invalid")
#: Token kinds counted, and the ``usage`` field of the record each comes from.
TOKEN_KINDS = {
    "input": "prompt_tokens",
    "output": "completion_tokens",
    "reasoning": "reasoning_tokens",
    "cached": "cached_tokens",
}
#: Error codes declared at zero: the gateway's shared codes and those only raised in one
#: place (others are admitted as they happen, within the bound).
KNOWN_ERROR_CODES = tuple(sorted({code.value for code in ErrorCode} | {
    "failover_exhausted", "model_not_available", "no_upstream_available", "upstream_rate_limited", "upstream_unavailable",
    "upstream_error", "upstream_idle_timeout", "upstream_disconnected", "upstream_rejected",
    "upstream_auth_failed", "upstream_not_found", "upstream_bad_frame", "upstream_capacity",
    "upstream_attempt_timeout", "upstream_empty_events", "upstream_pool_exhausted",
    "model_not_allowed", "rate_limited", "budget_exceeded", "concurrency_limited", "key_store_unavailable",
}))
OTHER = "other"
#: How many traffic-chosen values a label admits beyond the configured ones.
DYNAMIC_MODELS = 20
DYNAMIC_UPSTREAMS = 20
DYNAMIC_ERROR_CODES = 30
#: Error codes meaning the upstream's terminal failed the gateway's validation.
TERMINAL_VALIDATION_CODES = frozenset(
    {"tool_call_invalid", "upstream_incomplete", "tool_identity_changed", "empty_response"}
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Upstream error codes -> the HTTP status class they come from (when the attempt lacks a status).
_CODE_STATUS_CLASS = {
    "upstream_rate_limited": "4xx",
    "upstream_rejected": "4xx",
    "upstream_not_found": "4xx",
    "upstream_auth_failed": "4xx",
    "upstream_unavailable": "5xx",
    "upstream_error": "5xx",
    "upstream_timeout": "timeout",
    "upstream_idle_timeout": "timeout",
    "upstream_attempt_timeout": "timeout",
    "upstream_empty_events": "timeout",
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


class BoundedLabel:
    """Label values for one unbounded dimension, with at most ``len(known) + capacity``
    distinct values.

    Configured values always keep their name. Any other value keeps it once it has been
    seen ``min_hits`` times while there is room (so the frequent ones win the places and
    a stream of one-off names does not); until then, and once the places are taken, it is
    ``other``. Hit counts are kept for at most ``max_candidates`` values, then forgotten.
    """

    def __init__(self, known: Iterable[str] = (), capacity: int = 20, min_hits: int = 3,
                 max_candidates: int = 1000) -> None:
        self.known: set[str] = set(known)
        self.capacity = capacity
        self.min_hits = min_hits
        self.max_candidates = max_candidates
        self.admitted: set[str] = set()
        self._hits: dict[str, int] = {}

    def add_known(self, values: Iterable[str]) -> None:
        self.known.update(v for v in values if v)

    def __call__(self, value: str | None) -> str:
        if not value:
            return "none"
        if value in self.known or value in self.admitted:
            return value
        if len(self.admitted) >= self.capacity:
            return OTHER
        hits = self._hits.get(value, 0) + 1
        if hits >= self.min_hits:
            self._hits.pop(value, None)
            self.admitted.add(value)
            return value
        if len(self._hits) >= self.max_candidates:
            self._hits.clear()
        self._hits[value] = hits
        return OTHER

    def values(self) -> set[str]:
        """Every value this label may take now (``other`` included)."""
        return self.known | self.admitted | {OTHER}


def build_version() -> str:
    try:
        return metadata.version("codebuddy2api")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "unknown"


_PID_FILE = re.compile(r"_(\d+)\.db$")


class WorkersProcessCollector:
    """``process_*`` for every live worker of ``--workers N``, summed (memory, CPU, file
    descriptors; the earliest start time), whichever worker answers the scrape.

    prometheus-client's :class:`ProcessCollector` sees only its own process, so in
    multiprocess mode it is run once per worker pid found among the live-gauge files of
    ``PROMETHEUS_MULTIPROC_DIR`` (a worker removes them when it exits)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def worker_pids(self) -> list[int]:
        pids: set[int] = set()
        for name in os.listdir(self.directory):
            match = _PID_FILE.search(name)
            if name.startswith("gauge_live") and match:
                pids.add(int(match.group(1)))
        pids.add(os.getpid())
        return sorted(pid for pid in pids if os.path.exists(f"/proc/{pid}"))

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        pids = self.worker_pids()
        for pid in pids:
            collector = ProcessCollector(pid=lambda pid=pid: pid, registry=None)  # type: ignore[misc]
            for family in collector.collect():
                sample = family.samples[0] if family.samples else None
                if sample is None:
                    continue
                known = merged.get(family.name)
                if known is None:
                    merged[family.name] = family
                    continue
                old = known.samples[0]
                if family.name in ("process_start_time_seconds", "process_max_fds"):
                    value = min(old.value, sample.value)
                else:
                    value = old.value + sample.value
                known.samples[0] = old._replace(value=value)
        workers = GaugeMetricFamily(PREFIX + "workers", "Live worker processes whose process_* are summed here")
        workers.add_metric([], len(pids))
        yield from merged.values()
        yield workers
