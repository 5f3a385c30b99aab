"""A scripted OpenAI-compatible upstream on loopback for fault tests (issue #31).

Raw asyncio HTTP/1.1 with keep-alive (chunked bodies), so each fault is exactly the bytes
it names. The request's ``model`` picks the behaviour by its prefix:

- ``error``: one content chunk, then ``data: {"error": ...}`` and the end of the body
  (the connection stays open for reuse: the case that leaked one fd per request);
- ``drip``: a byte every ``DRIP_SECONDS`` that never completes an event;
- ``empty``: events that carry nothing (an empty delta), as fast as the socket takes them;
- ``slow``: a content event every ``DRIP_SECONDS``, forever;
- ``hold``: one content chunk, then nothing until the gateway closes the connection;
- anything else: a short text answer and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

DRIP_SECONDS = 0.2
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _content(text: str, finish: str | None = None) -> bytes:
    return _event({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


EMPTY_EVENT = _event({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                      "choices": [{"index": 0, "delta": {}, "finish_reason": None}]})
ERROR_EVENT = _event({"error": {"message": "upstream exploded", "type": "server_error", "code": "internal_error"}})


class ScriptedUpstream:
    """Start with ``await start()`` on the loop that will serve it; ``url`` is its base."""

    def __init__(self) -> None:
        self.url = ""
        self.holding = 0  # ``hold`` answers open now
        self.requests = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = json.loads(await reader.readexactly(length)) if length else {}
                self.requests += 1
                await self._answer(str(body.get("model", "")), reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, model: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        if model.startswith("error"):
            writer.write(_chunk(_content("Hello") + ERROR_EVENT) + b"0\r\n\r\n")
        elif model.startswith("drip"):
            writer.write(_chunk(b": an SSE comment is not an event\n"))
            while True:  # "data: {" and so on, one byte at a time: never a whole event
                for byte in b'data: {"choices": [':
                    await writer.drain()
                    await asyncio.sleep(DRIP_SECONDS)
                    writer.write(_chunk(bytes([byte])))
        elif model.startswith("empty"):
            while True:
                writer.write(_chunk(EMPTY_EVENT * 8))
                await writer.drain()
                await asyncio.sleep(0)
        elif model.startswith("slow"):
            while True:
                writer.write(_chunk(_content("x")))
                await writer.drain()
                await asyncio.sleep(DRIP_SECONDS)
        elif model.startswith("hold"):
            writer.write(_chunk(_content("Hello")))
            await writer.drain()
            self.holding += 1
            try:
                await reader.read()  # until the gateway closes its end
            finally:
                self.holding -= 1
            raise ConnectionError("closed by the gateway")
        else:
            writer.write(_chunk(_content("Hello there.") + _content("", "stop") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
