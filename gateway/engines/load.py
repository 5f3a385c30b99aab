"""The engines' own load, read from their Prometheus ``/metrics`` (vLLM), for the router.

The gateway counts only the calls it has in flight; an engine may also be queueing calls
from other gateway replicas or other clients. vLLM says so itself:
``vllm:num_requests_waiting`` (requests queued, not yet scheduled) and
``vllm:kv_cache_usage_perc`` (the share of its KV cache held by running requests). For each
upstream with ``engine_api = "vllm"``, :class:`EngineLoadPoller` reads them every
``interval`` seconds, off the request path (one bounded GET per engine, the text parsed in a
worker thread: vLLM's exposition is tens of kilobytes of histograms), and hands them to the
router (docs/routing.md, "The engines' own load").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.control import Engine, EngineControl
from gateway.engines.fleet import engine_of
from gateway.tasks import stop_tasks
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.routing import EngineLoad

log = structlog.get_logger(__name__)

#: Seconds between two reads of every engine's /metrics, and the bound of one read.
POLL_INTERVAL = 2.0
READ_TIMEOUT = 1.0
#: /metrics answers larger than this are not parsed (a misconfigured upstream).
MAX_METRICS_BYTES = 4 << 20

WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the second: vLLM before 0.10


def parse_engine_load(text: str) -> EngineLoad | None:
    """The load in one vLLM ``/metrics`` text: requests waiting (summed over the model
    names it serves) and KV cache usage (the highest); None when it reports no queue."""
    waiting: float | None = None
    usage: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == WAITING:
                waiting = (waiting or 0.0) + sample.value
            elif sample.name in KV_USAGE:
                usage = sample.value if usage is None else max(usage, sample.value)
    if waiting is None:
        return None
    return EngineLoad(waiting=max(0.0, waiting), kv_cache_usage=usage)


@dataclass
class _Target:
    replica_id: str  # the router's key: the upstream's base URL
    engine: Engine  # its name, root and headers (the first credential with a key)


class EngineLoadPoller:
    """Reads each vLLM engine's load every ``interval`` seconds and reports it to the
    pool's router (``report_load``). The engines are read from the pool each round, so
    credentials added or reloaded count too; an engine that does not answer within
    ``timeout`` is skipped this round (the router ignores an old report by itself)."""

    def __init__(self, pool: Callable[[], UpstreamPool], control: EngineControl,
                 interval: float = POLL_INTERVAL, timeout: float = READ_TIMEOUT) -> None:
        self.pool = pool
        self.control = control
        self.interval = interval
        self.timeout = timeout
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        await stop_tasks(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as exc:  # a background reading: it must outlive any one round's surprise
                log.warning("engine_load_poll_failed", error=type(exc).__name__)
            await asyncio.sleep(self.interval)

    async def poll_once(self) -> None:
        """One round: every vLLM engine's load, read at once, reported as it comes."""
        pool = self.pool()
        if not pool.router.uses_prefix:  # round-robin does not weigh load
            return
        targets: dict[str, _Target] = {}
        for credential in pool.credentials:
            upstream = credential.upstream
            known = targets.get(upstream.base_url)
            if upstream.engine_api == "vllm" and (known is None or (
                    credential.api_key and "authorization" not in known.engine.headers)):
                targets[upstream.base_url] = _Target(upstream.base_url, engine_of(credential))
        if len(targets) < 2:  # one engine: nothing to choose between
            return
        await asyncio.gather(*(self._read(pool, t) for t in targets.values()))

    async def _read(self, pool: UpstreamPool, target: _Target) -> None:
        http = self.control.http
        if http is None:
            return
        try:
            async with asyncio.timeout(self.timeout):
                response = await http.get(target.engine.root + "/metrics", headers=target.engine.headers)
            if response.status_code != 200 or len(response.content) > MAX_METRICS_BYTES:
                raise ValueError(f"HTTP {response.status_code}, {len(response.content)} bytes")
            load = await asyncio.to_thread(parse_engine_load, response.text)
        except (TimeoutError, httpx.HTTPError, ValueError) as exc:  # skipped this round
            log.debug("engine_load_unread", upstream=target.engine.name, reason=str(exc) or type(exc).__name__)
            return
        if load is not None:
            pool.router.report_load(target.replica_id, load)
