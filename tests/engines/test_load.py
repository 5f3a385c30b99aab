"""The engines' own load (gateway/engines/load.py): vLLM's /metrics text parsed, and the
simulator's /metrics read the way the poller reads a real engine's."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from gateway.engines.load import parse_engine_load
from gateway.simulator.server import create_simulator_app
from gateway.upstream.routing import EngineLoad

#: The shape of vLLM 0.11's exposition: HELP/TYPE lines, labels, counters and histograms around the gauges.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 5.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.87
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 123456.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 40.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 40.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 3.5
"""


def test_the_queue_is_summed_and_the_fullest_kv_cache_kept() -> None:
    assert parse_engine_load(VLLM_METRICS) == EngineLoad(waiting=7.0, kv_cache_usage=0.87)


def test_older_vllm_names_its_kv_cache_gpu_cache() -> None:
    text = "vllm:num_requests_waiting 3\nvllm:gpu_cache_usage_perc 0.5\n"
    assert parse_engine_load(text) == EngineLoad(waiting=3.0, kv_cache_usage=0.5)


def test_an_engine_that_reports_no_queue_reports_nothing() -> None:
    assert parse_engine_load("# an SGLang or llama.cpp exposition\nsglang:num_queue_reqs 4\n") is None
    assert parse_engine_load("") is None
    assert parse_engine_load("vllm:num_requests_waiting 2\n") == EngineLoad(waiting=2.0, kv_cache_usage=None)


def test_the_simulator_reports_its_queue_like_vllm() -> None:
    async def scenario() -> tuple[Any, ...]:
        transport = httpx.ASGITransport(app=create_simulator_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            idle = parse_engine_load((await client.get("/metrics")).text)
            await client.post("/_sim/engine_load", json={"waiting": 9, "kv_cache_usage": 0.75})
            loaded = parse_engine_load((await client.get("/metrics")).text)
            refused = (await client.post("/_sim/engine_load", json={"waiting": -1})).status_code
            await client.post("/pause", params={"mode": "keep"})  # a request that arrives now waits: one more
            call = asyncio.ensure_future(client.post("/v1/chat/completions", json={
                "model": "text", "messages": [{"role": "user", "content": "hi"}]}))
            async with asyncio.timeout(10):  # a frozen loop, not a slow machine
                while (queued := parse_engine_load((await client.get("/metrics")).text)) == loaded:
                    await asyncio.sleep(0.01)
            await client.post("/resume")
            answered = (await call).status_code
            after = parse_engine_load((await client.get("/metrics")).text)
        return idle, loaded, refused, queued, answered, after

    idle, loaded, refused, queued, answered, after = asyncio.run(scenario())
    assert idle == EngineLoad(waiting=0.0, kv_cache_usage=0.0)
    assert loaded == EngineLoad(waiting=9.0, kv_cache_usage=0.75)
    assert refused == 400
    assert queued == EngineLoad(waiting=10.0, kv_cache_usage=0.75) and answered == 200 and after == loaded


def test_the_poller_reports_each_vllm_engine_and_skips_one_that_fails() -> None:
    from gateway.engines.control import EngineControl
    from gateway.engines.load import EngineLoadPoller
    from gateway.upstream.credential import Credential, Upstream
    from gateway.upstream.pool import UpstreamPool
    from gateway.upstream.routing import CacheAwareRouter

    seen: list[tuple[str, str | None]] = []

    def engine(request: httpx.Request) -> httpx.Response:  # a unit seam: three engines' /metrics
        seen.append((str(request.url), request.headers.get("authorization")))
        if request.url.host == "broken":
            return httpx.Response(500)
        waiting = {"a": 4, "b": 0}[request.url.host]
        return httpx.Response(200, text=f"vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n")

    upstreams = [Upstream(f"u{h}", f"http://{h}:8000/v1", engine_api="vllm") for h in ("a", "b", "broken")]
    plain = Upstream("plain", "http://plain:8000/v1")  # no engine API: never read
    pool = UpstreamPool([Credential(upstreams[0], "sk-a"), Credential(upstreams[0], "sk-a2"),
                         Credential(upstreams[1], ""), Credential(upstreams[2], ""), Credential(plain, "")],
                        router=CacheAwareRouter(lambda: 0.0))

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as http:
            await EngineLoadPoller(lambda: pool, EngineControl(http)).poll_once()

    asyncio.run(scenario())
    assert sorted(seen) == [("http://a:8000/metrics", "Bearer sk-a"), ("http://b:8000/metrics", None),
                            ("http://broken:8000/metrics", None)]  # once per engine, at its server root
    reported = {r: load.waiting for r, (load, _) in pool.router.reported.items()}  # type: ignore[union-attr]
    assert reported == {"http://a:8000/v1": 4.0, "http://b:8000/v1": 0.0}
