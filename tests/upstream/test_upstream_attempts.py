"""UpstreamClient on httpx.MockTransport, and UpstreamAttempts' failover and attempt log
(a real pool with a fake clock); one loopback server for connection reuse."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from gateway.errors import GatewayError
from gateway.generation.policy import StreamPolicy
from gateway.settings import StreamMode
from gateway.upstream.attempts import UpstreamAttempts
from gateway.upstream.client import ANSWERED, DONE, UpstreamClient
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.failure_lessons import SERVER_ERROR_PENALTY
from gateway.upstream.pool import UpstreamPool

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def policy(failover_max: int = 2, upstream_stream: str = "always") -> StreamPolicy:
    return StreamPolicy(
        mode=StreamMode.COMPATIBLE, max_collect_bytes=0, tool_repair_attempts=0, keepalive_interval=1,
        connect_timeout=1, first_byte_timeout=1, idle_timeout=1, failover_max=failover_max,
        upstream_stream=upstream_stream, engine_extras={},
    )


def sse_body(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}


class Upstreams:
    """A MockTransport handler answering per credential key, logging what it was sent."""

    def __init__(self, answers: dict[str, httpx.Response]) -> None:
        self.answers = answers
        self.seen: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        key = request.headers["authorization"].removeprefix("Bearer ")
        self.seen.append({"key": key, "url": str(request.url), "body": orjson.loads(request.content)})
        return self.answers[key]


def make(answers: dict[str, httpx.Response], keys: list[str]) -> tuple[UpstreamClient, UpstreamPool, Upstreams, list[float]]:
    handler = Upstreams(answers)
    client = UpstreamClient(http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    now = [1000.0]
    upstream = Upstream("u", "http://upstream.test/v1", model_map={"m": "real-m"})
    pool = UpstreamPool([Credential(upstream, k) for k in keys], clock=lambda: now[0])
    return client, pool, handler, now


async def collect(attempts: UpstreamAttempts) -> list[Any]:
    return [item async for item in attempts.stream(BODY)]


async def test_client_streams_chunks_with_usage_requested() -> None:
    ok = httpx.Response(200, content=sse_body(CHUNK), headers={"content-type": "text/event-stream"})
    client, pool, handler, _ = make({"k1": ok}, ["k1"])
    items = await collect(UpstreamAttempts(pool, client, policy()))
    assert items == [ANSWERED, CHUNK, DONE]
    sent = handler.seen[0]
    assert sent["url"] == "http://upstream.test/v1/chat/completions"
    assert sent["body"]["model"] == "real-m" and sent["body"]["stream"] is True
    assert sent["body"]["stream_options"] == {"include_usage": True}


async def test_client_buffered_answer_becomes_chunks() -> None:
    answer = {"choices": [{"index": 0, "message": {"content": "whole"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    client, pool, handler, _ = make({"k1": httpx.Response(200, json=answer)}, ["k1"])
    items = await collect(UpstreamAttempts(pool, client, policy(upstream_stream="never")))
    assert items[0] is ANSWERED and items[-1] is DONE
    assert items[1]["choices"][0]["delta"] == {"role": "assistant", "content": "whole"}
    assert items[2] == {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    assert handler.seen[0]["body"]["stream"] is False


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [(404, "upstream_not_found", "not_found"), (400, "upstream_rejected", "invalid_request"),
     (401, "upstream_auth_failed", "upstream"), (503, "upstream_unavailable", "overloaded"),
     (504, "upstream_timeout", "timeout"), (500, "upstream_error", "upstream")],
)
async def test_client_maps_upstream_statuses(status: int, code: str, kind: str) -> None:
    failing = httpx.Response(status, json={"error": {"message": "nope"}})
    client, pool, _, _ = make({"k1": failing}, ["k1"])
    with pytest.raises(GatewayError) as caught:
        await collect(UpstreamAttempts(pool, client, policy(failover_max=0)))
    assert (caught.value.code, caught.value.kind, caught.value.upstream_status) == (code, kind, status)


async def test_client_rejects_a_frame_that_is_not_json() -> None:
    bad = httpx.Response(200, content=b"data: {nope\n\n", headers={"content-type": "text/event-stream"})
    client, pool, _, _ = make({"k1": bad}, ["k1"])
    with pytest.raises(GatewayError) as caught:
        await collect(UpstreamAttempts(pool, client, policy()))
    assert caught.value.code == "upstream_bad_frame"


async def test_client_reads_crlf_frames_comments_and_bytes_that_are_not_utf8() -> None:
    """The stream as some servers send it: CRLF line ends, keepalive comments, a token
    that cuts a character (an invalid UTF-8 byte becomes U+FFFD, the answer goes on)."""
    body = (b": ping\r\n\r\ndata: " + orjson.dumps(CHUNK) + b"\r\n\r\n"
            + b'data: {"choices":[{"index":0,"delta":{"content":"caf\xc3"}}]}\r\n\r\ndata: [DONE]\r\n\r\n')
    answer = httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    client, pool, _, _ = make({"k1": answer}, ["k1"])
    items = await collect(UpstreamAttempts(pool, client, policy()))
    assert items[:2] == [ANSWERED, CHUNK] and items[-1] is DONE
    assert items[2]["choices"][0]["delta"]["content"] == "caf\ufffd"


async def test_failover_after_a_5xx_logs_both_attempts_and_penalises_the_first() -> None:
    ok = httpx.Response(200, content=sse_body(CHUNK), headers={"content-type": "text/event-stream"})
    client, pool, handler, now = make({"k1": httpx.Response(500, text="boom"), "k2": ok}, ["k1", "k2"])
    attempts = UpstreamAttempts(pool, client, policy())
    items = await collect(attempts)
    assert items == [ANSWERED, CHUNK, DONE]
    assert [s["key"] for s in handler.seen] == ["k1", "k2"]
    assert [(a["status"], a.get("error")) for a in attempts.log] == [(500, "upstream_error"), (200, None)]
    assert all(a["credential"].startswith("fp_") and "k1" not in str(a) for a in attempts.log)
    assert attempts.upstream_model == "real-m"
    assert pool.credentials[0].penalty_until == now[0] + SERVER_ERROR_PENALTY
    assert [c.in_flight for c in pool.credentials] == [0, 0]  # every lease released


async def test_a_client_error_is_not_failed_over() -> None:
    client, pool, handler, _ = make({"k1": httpx.Response(400, json={"error": {"message": "bad"}})}, ["k1", "k2"])
    with pytest.raises(GatewayError) as caught:
        await collect(UpstreamAttempts(pool, client, policy()))
    assert caught.value.code == "upstream_rejected" and len(handler.seen) == 1


async def test_every_credential_rate_limited_says_when_to_retry() -> None:
    limited = httpx.Response(429, headers={"retry-after": "7"}, json={"error": {"message": "slow down"}})
    client, pool, handler, _ = make({"k1": limited, "k2": limited}, ["k1", "k2"])
    with pytest.raises(GatewayError) as caught:
        await collect(UpstreamAttempts(pool, client, policy()))
    assert caught.value.kind == "rate_limit" and caught.value.retry_after == 7
    assert len(handler.seen) == 2


async def test_no_failover_once_the_upstream_answered() -> None:
    cut = httpx.Response(200, content=sse_body(CHUNK, done=False), headers={"content-type": "text/event-stream"})
    client, pool, handler, _ = make({"k1": cut, "k2": cut}, ["k1", "k2"])
    attempts = UpstreamAttempts(pool, client, policy())
    items = await collect(attempts)  # a stream without [DONE] is not an error here (the accumulator judges it)
    assert items == [ANSWERED, CHUNK] and len(handler.seen) == 1 and len(attempts.log) == 1


class ClosesIdleAtNextRequest:
    """A loopback HTTP/1.1 server that answers the first request on a connection with
    keep-alive, then closes that connection when the next request on it arrives, unread
    and unanswered: what a server whose keep-alive timeout fires just as the client reuses
    the connection does (uvicorn, cpp-httplib: 5 s)."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0
        self.closed_unanswered = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if served:  # the keep-alive timeout fired: close without answering
                    self.closed_unanswered += 1
                    break
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                body = sse_body(CHUNK)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"content-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                served += 1
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_pooled_connection_the_upstream_closes_is_not_a_failed_attempt() -> None:
    server = ClosesIdleAtNextRequest()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client = UpstreamClient()
    credential = Credential(Upstream("u", f"http://127.0.0.1:{port}/v1"), None)
    try:
        for _ in range(3):
            items = [item async for item in client.stream_chat(credential, BODY, policy())]
            assert items == [ANSWERED, CHUNK, DONE]
    finally:
        await client.aclose()
        listener.close()
    # requests 2 and 3 went out on the kept connection, were closed unanswered, and were sent
    # again on a new one (before: GatewayError upstream_unreachable, a 502 with one credential)
    assert (server.answered, server.closed_unanswered, server.connections) == (3, 2, 3)


def empty_stream_upstream(breaks_first_json: bool = False) -> tuple[UpstreamClient, list[bool]]:
    """llama-cpp-python on a stream it cannot produce (tool_choice auto picking a tool): 200,
    text/event-stream and no byte; a JSON request gets the whole answer. ``breaks_first_json``:
    the first JSON request breaks unanswered (the connection the failed stream closed).
    Returns the client and, per request, whether it asked to stream."""
    answer = {"choices": [{"index": 0, "message": {"content": "whole"}, "finish_reason": "stop"}]}
    seen: list[bool] = []

    def handler(request: httpx.Request) -> httpx.Response:
        streamed = orjson.loads(request.content)["stream"]
        seen.append(streamed)
        if streamed:
            return httpx.Response(200, content=b"", headers={"content-type": "text/event-stream"})
        if breaks_first_json and seen.count(False) == 1:
            raise httpx.ReadError("connection closed by the peer")
        return httpx.Response(200, json=answer)

    return UpstreamClient(http=httpx.AsyncClient(transport=httpx.MockTransport(handler))), seen


@pytest.mark.parametrize(("upstream_stream", "falls_back"), [("auto", True), ("always", False)])
async def test_auto_asks_for_json_after_an_empty_event_stream(upstream_stream: str, falls_back: bool) -> None:
    """``auto`` asks again without streaming when a stream was an empty 200; ``always`` does not."""
    client, seen = empty_stream_upstream()
    credential = Credential(Upstream("u", "http://upstream.test/v1"), "k1")
    stream = client.stream_chat(credential, BODY, policy(failover_max=0, upstream_stream=upstream_stream))
    if not falls_back:
        with pytest.raises(GatewayError, match="empty body"):
            [item async for item in stream]
        assert seen == [True]
        return
    items = [item async for item in stream]
    assert seen == [True, False]
    assert items[0] is ANSWERED and items.count(ANSWERED) == 1 and items[-1] is DONE
    assert items[1]["choices"][0]["delta"] == {"role": "assistant", "content": "whole"}


async def test_auto_fallback_tries_a_fresh_connection_once() -> None:
    """The server that failed inside its stream closes that connection; the JSON request
    sent over it at once breaks unanswered: one more try (``_send``), then the answer."""
    client, seen = empty_stream_upstream(breaks_first_json=True)
    credential = Credential(Upstream("u", "http://upstream.test/v1"), "k1")
    items = [item async for item in client.stream_chat(credential, BODY, policy(failover_max=0, upstream_stream="auto"))]
    assert seen == [True, False, False]
    assert items.count(ANSWERED) == 1 and items[1]["choices"][0]["delta"]["content"] == "whole"


async def test_a_head_that_never_comes_fails_over_and_puts_the_hung_credential_last_for_longer() -> None:
    """Issue #40: a hung engine's credential is tried last for HUNG_PENALTY, not 5 s."""
    from gateway.upstream.failure_lessons import HUNG_PENALTY

    ok = httpx.Response(200, content=sse_body(CHUNK), headers={"content-type": "text/event-stream"})
    _, pool, _, now = make({"k2": ok}, ["k1", "k2"])

    class Hung(Upstreams):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.headers["authorization"] == "Bearer k1":
                raise httpx.ReadTimeout("no response head", request=request)  # what httpx says after the wait
            return super().__call__(request)

    hung = Hung({"k2": ok})
    client = UpstreamClient(http=httpx.AsyncClient(transport=httpx.MockTransport(hung)))
    attempts = UpstreamAttempts(pool, client, policy())
    assert await collect(attempts) == [ANSWERED, CHUNK, DONE]
    assert [(a["status"], a.get("error")) for a in attempts.log] == [(None, "upstream_timeout"), (200, None)]
    assert pool.credentials[0].penalty_until == now[0] + HUNG_PENALTY


async def test_chat_attempts_at_an_engine_api_upstream_carry_their_own_x_request_id() -> None:
    """Each attempt at an upstream with an engine API is sent with ``X-Request-Id:
    <request id>-<attempt number>`` (what the engine's /abort_requests takes), logged as
    ``engine_request_id`` and held as ``engine_request`` while it runs; other upstreams get none."""
    ok = httpx.Response(200, content=sse_body(CHUNK), headers={"content-type": "text/event-stream"})
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-request-id"))
        return ok if request.headers["authorization"] == "Bearer k2" else httpx.Response(500, json={"error": "busy"})

    client = UpstreamClient(http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    engine = Upstream("e", "http://engine.test/v1", engine_api="vllm")
    pool = UpstreamPool([Credential(engine, "k1"), Credential(engine, "k2")], clock=lambda: 1000.0)
    attempts = UpstreamAttempts(pool, client, policy(), request_id="req_abc")
    running: list[Any] = []
    async for _ in attempts.stream(BODY):
        running.append(attempts.engine_request)
    assert seen == ["req_abc-1", "req_abc-2"]
    assert [a["engine_request_id"] for a in attempts.log] == ["req_abc-1", "req_abc-2"]
    assert {(c.api_key, rid) for c, rid in running} == {("k2", "req_abc-2")} and attempts.engine_request is None

    seen.clear()
    plain_pool = UpstreamPool([Credential(Upstream("u", "http://upstream.test/v1"), "k2")], clock=lambda: 1000.0)
    plain = UpstreamAttempts(plain_pool, client, policy(), request_id="req_abc")
    assert await collect(plain) == [ANSWERED, CHUNK, DONE]
    assert seen == [None] and "engine_request_id" not in plain.log[0]
