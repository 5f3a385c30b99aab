"""The simulator's vLLM dev RL API (gateway/simulator/engine_control.py) over real HTTP:
pause in its three modes, resume, the queue while paused, abort_requests, weight versions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from gateway.simulator.server import TEXT, create_simulator_app
from tests.conftest import ServerLoop

#: 52 chunks of two characters, 20 ms apart: long enough to pause in the middle of.
SLOW = "text;chunk=2;delay=0.02"


@pytest.fixture()
async def engine(server_loop: ServerLoop) -> AsyncIterator[httpx.AsyncClient]:
    """A simulator of its own per test: a pause must not reach other tests' upstream."""
    url = server_loop.serve(create_simulator_app())
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        yield client


class Stream:
    """One streamed chat request, read in a task: its chunks as they arrive."""

    def __init__(self, client: httpx.AsyncClient, model: str = SLOW, request_id: str | None = None) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.done = False
        headers = {"x-request-id": request_id} if request_id else {}
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}}
        self.task = asyncio.create_task(self._read(client, body, headers))

    async def _read(self, client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]) -> None:
        async with aconnect_sse(client, "POST", "/v1/chat/completions", json=body, headers=headers) as source:
            assert source.response.status_code == 200
            async for event in source.aiter_sse():
                if event.data == "[DONE]":
                    self.done = True
                else:
                    self.chunks.append(json.loads(event.data))

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c["choices"])

    @property
    def finish_reasons(self) -> list[str]:
        return [c["choices"][0]["finish_reason"] for c in self.chunks if c["choices"] and c["choices"][0]["finish_reason"]]

    @property
    def usage(self) -> dict[str, Any] | None:
        return next((c["usage"] for c in self.chunks if c.get("usage")), None)

    async def until(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.chunks) < count:
                await asyncio.sleep(0.005)

    async def finished(self) -> None:
        async with asyncio.timeout(10):
            await self.task


async def _state(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/_sim/engine")).json()  # type: ignore[no-any-return]


async def _until_state(client: httpx.AsyncClient, key: str, value: Any) -> None:
    async with asyncio.timeout(10):
        while (await _state(client))[key] != value:
            await asyncio.sleep(0.01)


async def test_keep_freezes_mid_stream_and_resume_finishes_the_same_answer(engine: httpx.AsyncClient) -> None:
    stream = Stream(engine)
    await stream.until(5)
    assert (await engine.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
    assert (await engine.get("/is_paused")).json() == {"is_paused": True}
    await asyncio.sleep(0.2)  # a chunk that passed the gate before the pause may still land
    frozen = len(stream.chunks)
    await asyncio.sleep(0.3)
    assert len(stream.chunks) == frozen and not stream.done, "a kept stream emitted while paused"
    assert frozen < 50 and (await _state(engine))["in_flight"] == 1
    assert (await engine.post("/update_weight_version", json={"weight_version": "v2"})).json() == {"weight_version": "v2"}
    assert (await engine.post("/resume")).json() == {"status": "resumed"}
    await stream.finished()
    assert stream.done and stream.text == TEXT and stream.finish_reasons == ["stop"]
    assert (await engine.get("/is_paused")).json() == {"is_paused": False}
    assert (await engine.get("/weight_info")).json() == {"weight_version": "v2"}


async def test_abort_ends_in_flight_streams_after_the_sent_tokens_and_new_requests_wait(engine: httpx.AsyncClient) -> None:
    first, second = Stream(engine), Stream(engine)
    await first.until(4)
    await second.until(4)
    assert (await engine.post("/pause")).json() == {"status": "paused"}  # vLLM's default mode: abort
    await first.finished()
    await second.finished()
    for stream in (first, second):
        assert stream.done and stream.finish_reasons == ["abort"]
        assert stream.text and TEXT.startswith(stream.text) and stream.text != TEXT
        assert stream.usage is not None and stream.usage["completion_tokens"] == len(stream.text) // 4 + 1
    queued = Stream(engine)
    await asyncio.sleep(0.3)
    assert queued.chunks == [] and (await _state(engine))["in_flight"] == 0, "a request ran while paused"
    assert (await engine.get("/is_paused")).json() == {"is_paused": True}
    await engine.post("/resume")
    await queued.finished()
    assert queued.text == TEXT and queued.finish_reasons == ["stop"]
    assert (await _state(engine))["aborted"] == 2


async def test_wait_lets_in_flight_finish_before_pause_answers(engine: httpx.AsyncClient) -> None:
    stream = Stream(engine)
    await stream.until(3)
    async with asyncio.timeout(10):
        paused = await engine.post("/pause", params={"mode": "wait"})
    assert paused.json() == {"status": "paused"}
    assert (await _state(engine))["in_flight"] == 0  # it answered once the stream had ended
    await stream.finished()
    assert stream.text == TEXT and stream.finish_reasons == ["stop"]
    queued = Stream(engine, "text")
    await asyncio.sleep(0.2)
    assert queued.chunks == [], "a request ran while paused"
    await engine.post("/resume")
    await queued.finished()
    assert queued.text == TEXT


async def test_abort_requests_ends_only_the_named_request(engine: httpx.AsyncClient) -> None:
    named, other = Stream(engine, request_id="req-a"), Stream(engine, request_id="req-b")
    await named.until(3)
    await other.until(3)
    assert (await engine.post("/abort_requests", json={"request_ids": ["req-a", "nope"]})).json() == {"aborted": 1}
    await named.finished()
    await other.finished()
    assert named.finish_reasons == ["abort"] and TEXT.startswith(named.text) and named.text != TEXT
    assert other.finish_reasons == ["stop"] and other.text == TEXT
    assert (await engine.get("/is_paused")).json() == {"is_paused": False}


async def test_a_kept_stream_aborted_while_frozen_ends_with_abort(engine: httpx.AsyncClient) -> None:
    stream = Stream(engine)
    await stream.until(3)
    await engine.post("/pause", params={"mode": "keep"})
    await _until_state(engine, "paused_mode", "keep")
    await engine.post("/pause", params={"mode": "abort"})
    await stream.finished()
    assert stream.finish_reasons == ["abort"] and TEXT.startswith(stream.text) and stream.text != TEXT
    assert (await engine.get("/is_paused")).json() == {"is_paused": True}


async def test_non_streaming_requests_wait_while_paused(engine: httpx.AsyncClient) -> None:
    await engine.post("/pause", params={"mode": "keep"})
    body = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}
    pending = asyncio.create_task(engine.post("/v1/chat/completions", json=body))
    completion = asyncio.create_task(engine.post("/v1/completions", json={"model": "text", "prompt": "hi"}))
    await asyncio.sleep(0.3)
    assert not pending.done() and not completion.done()
    await engine.post("/resume")
    async with asyncio.timeout(10):
        answer, text = await pending, await completion
    assert answer.json()["choices"][0]["message"]["content"] == TEXT
    assert text.status_code == 200 and text.json()["choices"][0]["text"]


async def test_weight_version_and_bad_input(engine: httpx.AsyncClient) -> None:
    assert (await engine.get("/weight_info")).json() == {"weight_version": "default"}
    bad_mode = await engine.post("/pause", params={"mode": "later"})
    assert bad_mode.status_code == 400 and "mode" in bad_mode.json()["error"]
    assert (await engine.get("/is_paused")).json() == {"is_paused": False}
    for payload in ({}, {"weight_version": ""}, {"weight_version": 2}):
        refused = await engine.post("/update_weight_version", json=payload)
        assert refused.status_code == 400 and "weight_version" in refused.json()["error"]
    refused = await engine.post("/abort_requests", json={"request_ids": "req-a"})
    assert refused.status_code == 400 and "request_ids" in refused.json()["error"]
    assert (await engine.get("/weight_info")).json() == {"weight_version": "default"}
