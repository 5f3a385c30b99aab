"""The frames of a Responses WebSocket, apart from the socket and the event loop.

A client frame read as a request (:func:`read_frame`: pure, so a large one is read off the
loop), the bounded :class:`Inbox` of frames waiting to be answered and why one is refused,
an answer's SSE frames and errors as text frames (:func:`sse_data`, :func:`wrapped_error`),
the close codes, and a big frame's freed heap given back (:func:`release_freed_memory`).

Its own module so that :mod:`gateway.protocols.responses.websocket` holds only the
connection (its turns, its remembered conversations, the caps on connections): that module
imports from this one, never the reverse.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import ErrorCode, GatewayError, invalid_request
from gateway.protocols.base import load_json_object
from gateway.protocols.openai_shapes import error_json

#: Client frames that need no answer.
_IGNORED_TYPES = frozenset({"response.processed"})

#: Client frames that may wait while one request is answered (Codex: none; a client that
#: pipelines a few requests fits; a flood does not).
MAX_QUEUED_FRAMES = 8

#: RFC 6455 close codes used here.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TOO_BIG = 1009
CLOSE_SERVICE_RESTART = 1012  # the gateway is stopping: reconnect (to another replica)
CLOSE_TRY_AGAIN_LATER = 1013

#: A frame at least this big is followed by :func:`release_freed_memory`.
TRIM_AFTER_BYTES = 4 * 1024 * 1024


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Hand freed heap pages back to the system (glibc ``malloc_trim``; ctypes releases the
    GIL meanwhile, so run it in a thread). A big frame parses into ~20 times its size in
    small objects; freed, glibc keeps most of those pages, so the process would look as big
    after the frame as during it."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the connection stops reading: the wrapped error to send and the close code."""

    error: GatewayError
    close_code: int


def frame_size(message: dict[str, Any]) -> int:
    """A received frame's payload size in bytes (text as its UTF-8 encoding)."""
    text = message.get("text")
    if text is not None:
        return len(text) if text.isascii() else len(text.encode())
    return len(message.get("bytes") or b"")


class Inbox:
    """The client frames waiting to be answered, bounded in count and in bytes.

    Pure state fed one received frame at a time (:meth:`offer`); the connection's reader
    stops at the first refusal, so nothing past the bound is ever held.
    """

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.frames: deque[tuple[dict[str, Any], int]] = deque()
        self.bytes = 0

    def offer(self, message: dict[str, Any]) -> Refusal | None:
        """Queue ``message``, or say why it is refused (then it is not queued)."""
        size = frame_size(message)
        if size > self.max_bytes:
            return Refusal(GatewayError(
                "too_large", ErrorCode.REQUEST_TOO_LARGE,
                f"the frame is over the limit of {self.max_bytes} bytes",
            ), CLOSE_TOO_BIG)
        if len(self.frames) >= self.max_frames or self.bytes + size > self.max_bytes:
            return Refusal(invalid_request(
                f"more than {self.max_frames} frames (or {self.max_bytes} bytes) sent while a response"
                " was being answered: send one response.create and wait for its terminal event",
                code="too_many_queued_frames",
            ), CLOSE_POLICY_VIOLATION)
        self.frames.append((message, size))
        self.bytes += size
        return None

    def take(self) -> tuple[dict[str, Any], int] | None:
        """The oldest waiting frame and its size (measured once, in :meth:`offer`)."""
        if not self.frames:
            return None
        message, size = self.frames.popleft()
        self.bytes -= size
        return message, size


@dataclass(frozen=True)
class Frame:
    """A client's ``response.create`` frame: ``prewarm`` (``generate: false``) and the
    Responses request body it stands for (always streamed)."""

    prewarm: bool
    body: bytes


def read_frame(raw: bytes | str) -> Frame | None:
    """A client frame as a request (pure; run off the loop for large frames: a worker
    process may run it); None for the frame types the gateway ignores."""
    value = load_json_object(raw, what="the frame")
    kind = value.get("type")
    if kind in _IGNORED_TYPES:
        return None
    if kind != "response.create":
        raise invalid_request(
            f"unsupported frame type {kind!r} (expected 'response.create')",
            param="type",
            code="unsupported_event_type",
        )
    body = {k: v for k, v in value.items() if k not in ("type", "generate")}
    body["stream"] = True  # a WebSocket answer is always the event stream
    return Frame(prewarm=value.get("generate") is False, body=orjson.dumps(body))


def wrapped_error(err: GatewayError) -> dict[str, Any]:
    """A request error as Codex's WebSocket client reads it (status = the HTTP one)."""
    return {"type": "error", "status": err.status, **error_json(err)}


def sse_data(buffer: bytearray) -> list[bytes]:
    """Complete SSE frames' ``data`` payloads taken from ``buffer`` (the rest stays)."""
    out: list[bytes] = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return out
        frame = bytes(buffer[:end])
        del buffer[: end + 2]
        for line in frame.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[6:])
