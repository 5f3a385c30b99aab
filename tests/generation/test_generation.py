"""The generation loop (gateway/generation/run.py) with a scripted upstream-attempts fake:
opening frames before any keepalive, ttft_ms, abort, internal errors; no server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import structlog

from gateway.errors import GatewayError
from gateway.generation.outcome import internal_error
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestRecord
from gateway.generation.run import GenerationRun, RunningGenerations
from gateway.protocols.chat import ChatRoom
from gateway.protocols.messages.room import MessagesRoom
from gateway.protocols.responses.room import ResponsesRoom
from gateway.settings import StreamMode
from gateway.upstream.client import ANSWERED, DONE


class DictStore:
    """A ResponseStorage in memory."""

    def __init__(self) -> None:
        self.saved: dict[str, dict[str, Any]] = {}

    async def save(self, response_id: str, record: dict[str, Any], owner: str) -> None:
        self.saved[response_id] = record

    async def load(self, response_id: str, owner: str) -> dict[str, Any] | None:
        return self.saved.get(response_id)


ROOMS = {"chat": ChatRoom, "messages": MessagesRoom, "responses": lambda: ResponsesRoom(DictStore())}
BODIES = {
    "chat": {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    "messages": {"model": "m", "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
    "responses": {"model": "m", "stream": True, "store": False, "input": "hi"},
}


#: with usage, Messages never falls back to tokenizing (loading o200k takes seconds)
USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def chunk(content: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class FakeAttempts:
    """Stands in for UpstreamAttempts: waits for ``release`` before answering, then
    yields ``items``; records whether the stream was closed."""

    def __init__(self, items: list[Any], release: asyncio.Event | None = None, hang: bool = False) -> None:
        self.items = items
        self.release = release
        self.hang = hang
        self.log: list[dict[str, Any]] = []
        self.upstream_model: str | None = None
        self.closed = False

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[Any]:
        try:
            if self.release is not None:
                await self.release.wait()
            yield ANSWERED
            for item in self.items:
                yield item
            if self.hang:
                await asyncio.Event().wait()
        finally:
            self.closed = True


def policy(mode: str, keepalive: float = 0.01) -> StreamPolicy:
    return StreamPolicy(
        mode=StreamMode(mode), max_collect_bytes=0, tool_repair_attempts=1, keepalive_interval=keepalive,
        connect_timeout=1, first_byte_timeout=1, idle_timeout=1, failover_max=0, upstream_stream="always",
        engine_extras={},
    )


def make_run(protocol: str, mode: str, attempts: FakeAttempts, keepalive: float = 0.01) -> GenerationRun:
    room = ROOMS[protocol]()
    parsed = room.parse(orjson.dumps(BODIES[protocol]), {})
    record = RequestRecord(request_id="req_test", protocol=protocol, started_at=0.0)
    return GenerationRun(room, parsed, policy(mode, keepalive), record, attempts)  # type: ignore[arg-type]


def frames(data: bytes) -> list[dict[str, Any] | str]:
    """SSE frames as their JSON data (comments as the string ``keepalive``)."""
    out: list[dict[str, Any] | str] = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            out.append("keepalive")
            continue
        data_line = next(line for line in block.split("\n") if line.startswith("data: "))[6:]
        out.append("[DONE]" if data_line == "[DONE]" else orjson.loads(data_line))
    return out


async def run_stream(run: GenerationRun, release: asyncio.Event | None = None) -> list[bytes | GatewayError]:
    """Consume the stream; the upstream is released once the first keepalive went out."""
    outputs: list[bytes | GatewayError] = []
    async for out in run.stream():
        outputs.append(out)
        if release is not None and run.record.keepalives:
            release.set()
    return outputs


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
@pytest.mark.parametrize("protocol", ["chat", "messages", "responses"])
async def test_keepalive_before_the_upstream_answers_follows_the_opening_frames(protocol: str, mode: str) -> None:
    release = asyncio.Event()
    attempts = FakeAttempts([chunk("Hel"), chunk("lo"), chunk(finish="stop"), USAGE, DONE], release)
    run = make_run(protocol, mode, attempts)
    outputs = await run_stream(run, release)
    assert run.record.keepalives >= 1 and run.error is None
    sent = frames(b"".join(o for o in outputs if isinstance(o, bytes)))
    first_keepalive = outputs[0]
    assert isinstance(first_keepalive, bytes)
    opening = frames(first_keepalive)
    if protocol == "chat":
        assert opening[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]
        assert opening[1] == "keepalive"
        text = "".join(f["choices"][0]["delta"].get("content") or "" for f in sent if isinstance(f, dict) and f.get("choices"))
        assert text == "Hello" and sent[-1] == "[DONE]"
    elif protocol == "messages":
        assert [f["type"] for f in opening] == ["message_start", "ping"]  # type: ignore[index]
        assert sent[-1] == {"type": "message_stop"}
    else:
        types = [f["type"] for f in sent]  # type: ignore[index]
        assert types[:3] == ["response.created", "response.in_progress", "response.in_progress"]
        assert [f["sequence_number"] for f in sent] == list(range(len(sent)))  # type: ignore[index]
        assert types[-1] == "response.completed"
        assert sent[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"  # type: ignore[index]


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
async def test_ttft_is_the_first_content_frame(mode: str) -> None:
    release = asyncio.Event()
    attempts = FakeAttempts([chunk("Hi"), chunk(finish="stop"), USAGE, DONE], release)
    run = make_run("messages", mode, attempts)
    seen_before_content: list[float | None] = []
    content_seen = False
    async for out in run.stream():
        assert isinstance(out, bytes)
        content_seen = content_seen or b"text_delta" in out
        if not content_seen:
            seen_before_content.append(run.record.ttft_ms)
        else:
            assert run.record.ttft_ms is not None
        release.set()
    assert seen_before_content and all(t is None for t in seen_before_content)
    assert run.record.ttft_ms is not None


@pytest.mark.parametrize("mode", ["compatible", "realtime"])
async def test_abort_ends_the_stream_with_the_named_error_and_closes_the_upstream(mode: str) -> None:
    attempts = FakeAttempts([chunk("partial ")], hang=True)
    run = make_run("messages", mode, attempts, keepalive=60)
    running = RunningGenerations()
    running.add(run)
    shutdown = GatewayError("overloaded", "server_shutting_down", "the gateway is shutting down")
    outputs: list[bytes | GatewayError] = []

    async def consume() -> None:
        async for out in run.stream():
            outputs.append(out)

    task = asyncio.create_task(consume())
    while not run.committed:
        await asyncio.sleep(0)
    assert running.abort_all(shutdown) == 1
    await asyncio.wait_for(task, 30)
    assert attempts.closed and run.error is shutdown
    last = frames(outputs[-1])[-1]  # type: ignore[arg-type]
    assert last == {"type": "error", "error": {"type": "overloaded_error", "message": "server_shutting_down: the gateway is shutting down"}}


async def test_abort_before_the_upstream_answered_is_an_http_error() -> None:
    attempts = FakeAttempts([], release=asyncio.Event())
    run = make_run("chat", "realtime", attempts, keepalive=60)
    shutdown = GatewayError("overloaded", "server_shutting_down", "the gateway is shutting down")
    task = asyncio.create_task(run_stream(run))
    await asyncio.sleep(0.01)
    run.abort(shutdown)
    outputs = await asyncio.wait_for(task, 30)
    assert outputs == [shutdown] and not run.committed and attempts.closed


async def test_a_bug_in_the_encoder_becomes_the_in_stream_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = FakeAttempts([chunk("Hi"), chunk(finish="stop"), DONE])
    run = make_run("chat", "realtime", attempts)
    real_encode = run.encoder.encode

    def encode(event: Any) -> bytes:
        if type(event).__name__ == "Finish":
            raise RuntimeError("encoder bug")
        return real_encode(event)

    monkeypatch.setattr(run.encoder, "encode", encode)
    with structlog.testing.capture_logs() as logs:
        outputs = await run_stream(run)
    assert run.error is not None and run.error.code == "internal_error" and run.error.status == 500
    sent = frames(b"".join(o for o in outputs if isinstance(o, bytes)))
    assert sent[-2] == {"error": {"message": "internal error (RuntimeError)", "type": "server_error", "param": None, "code": "internal_error"}}
    assert sent[-1] == "[DONE]"
    logged = [e for e in logs if e["event"] == "internal_error"]
    assert logged and logged[0]["request_id"] == "req_test" and logged[0]["log_level"] == "error"
    assert isinstance(logged[0]["exc_info"], RuntimeError)


def test_internal_error_hides_the_message_from_the_client() -> None:
    with structlog.testing.capture_logs():
        err = internal_error(ValueError("secret sk-123 in a message"), "req_x", "parse")
    assert err.status == 500 and err.code == "internal_error" and "sk-123" not in err.message


async def test_abort_closes_the_upstream_even_while_the_queue_is_full() -> None:
    attempts = FakeAttempts([chunk("x") for _ in range(500)], hang=True)
    run = make_run("chat", "realtime", attempts, keepalive=60)
    stream = run.stream()
    first = await stream.__anext__()  # the consumer then stalls (a slow client)
    assert isinstance(first, bytes)
    for _ in range(200):
        await asyncio.sleep(0)
    assert run._queue.full() and not attempts.closed  # the pump waits on the full queue
    run.abort(GatewayError("overloaded", "server_shutting_down", "the gateway is shutting down"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert attempts.closed  # closed at once, not whenever the generator is collected
    rest = [out async for out in stream]
    assert rest and b"server_shutting_down" in rest[-1]  # type: ignore[operator]


async def test_a_stored_answer_is_kept_before_its_terminal_frame_goes_out() -> None:
    """A client that reads ``response.completed`` and at once continues from it
    (``previous_response_id``) finds it stored: the store write is not after the end."""
    store = DictStore()
    room = ResponsesRoom(store)
    parsed = room.parse(orjson.dumps({**BODIES["responses"], "store": True}), {})
    record = RequestRecord(request_id="req_test", protocol="responses", started_at=0.0)
    attempts = FakeAttempts([chunk("Hi"), chunk(finish="stop"), USAGE, DONE])
    run = GenerationRun(room, parsed, policy("realtime", 60), record, attempts)  # type: ignore[arg-type]
    stored_when_terminal: list[bool] = []
    async for out in run.stream():
        assert isinstance(out, bytes)
        if b"response.completed" in out:
            stored_when_terminal.append(run.response_id in store.saved)
    assert stored_when_terminal == [True]
    assert store.saved[run.response_id]["response"]["status"] == "completed"


@pytest.mark.parametrize("leaves_after", ["terminal", "first frame"])
async def test_a_client_that_hangs_up_after_the_terminal_frame_had_the_whole_answer(leaves_after: str) -> None:
    """The race a WebSocket client (or an SSE client reading to the last event) runs: it
    has the terminal event and closes before the response's final empty body is written.
    That request succeeded; one that leaves before the terminal was cancelled."""
    from gateway.generation.response import GenerationResponse

    attempts = FakeAttempts([chunk("Hi"), chunk(finish="stop"), USAGE, DONE], release=asyncio.Event())
    run = make_run("messages", "realtime", attempts, keepalive=0.01)
    gone = asyncio.Event()
    decided: list[bool] = []

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        body = message.get("body", b"")
        attempts.release.set()  # type: ignore[union-attr]
        if gone.is_set():
            await asyncio.sleep(0.05)  # the listener sees the hang-up while this send is in flight
        elif b"message_stop" in body or (leaves_after == "first frame" and body):
            gone.set()  # the client has this frame and hangs up

    response = GenerationResponse(run, {}, decided.append)
    await asyncio.wait_for(response({"type": "http"}, receive, send), 30)
    assert decided == [leaves_after == "terminal"]


@pytest.mark.parametrize("protocol", ["chat", "messages", "responses"])
async def test_a_compatible_replay_goes_out_in_bounded_writes(protocol: str) -> None:
    """A long answer is replayed as several writes of about REPLAY_WRITE_BYTES (each awaited
    by the server's send), never the whole encoded answer at once; joined, they are the
    whole answer, terminal last."""
    from gateway.generation.run import REPLAY_WRITE_BYTES

    piece = "0123456789abcdef" * 64  # 1 KiB
    attempts = FakeAttempts([chunk(piece) for _ in range(600)] + [chunk(finish="stop"), USAGE, DONE])
    run = make_run(protocol, "compatible", attempts, keepalive=60)
    outputs = [o for o in await run_stream(run) if isinstance(o, bytes)]
    writes = [o for o in outputs if o]
    assert len(writes) >= 600 * 1024 // REPLAY_WRITE_BYTES
    # one write: past the bound by at most one delta's frame (a replayed piece is <= 16 KiB of
    # text); a block's closing frames repeat its whole text (Responses' *.done) and are one event
    for write in writes[:-1]:
        deltas = [f for f in write.split(b"\n\n") if b'.done"' not in f]
        assert sum(len(f) + 2 for f in deltas) < REPLAY_WRITE_BYTES + 20 * 1024
    sent = frames(b"".join(writes))
    if protocol == "chat":
        text = "".join(f["choices"][0]["delta"].get("content") or "" for f in sent
                       if isinstance(f, dict) and f.get("choices"))
    elif protocol == "messages":
        text = "".join(f["delta"].get("text", "") for f in sent if isinstance(f, dict) and f["type"] == "content_block_delta")
    else:
        text = "".join(f["delta"] for f in sent if isinstance(f, dict) and f["type"] == "response.output_text.delta")
    assert text == piece * 600 and run.terminated and run.error is None
