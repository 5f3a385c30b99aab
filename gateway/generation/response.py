"""How a generation answers over HTTP: :func:`error_response` (a protocol-shaped error with
its real status) and :class:`GenerationResponse`, the streamed answer that holds its status
line until the run's first output, so an error before any byte is still a real HTTP error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.generation.outcome import internal_error
from gateway.generation.run import Run
from gateway.protocols.base import ProtocolRoom

SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}


def error_response(room: ProtocolRoom, err: GatewayError, headers: dict[str, str] | None = None) -> Response:
    """A protocol-shaped error with its real HTTP status (and Retry-After when known)."""
    out = dict(headers or {})
    if err.retry_after is not None:
        out["retry-after"] = str(err.retry_after)
    return JSONResponse(room.error_body(err), status_code=err.status, headers=out)


class GenerationResponse:
    """ASGI response for a streamed generation.

    Holds the status line until the run's first output: a GatewayError then becomes a
    real HTTP error; bytes commit a 200 SSE stream. Races the stream against client
    disconnect (as Starlette's StreamingResponse does); when both have stopped it calls
    ``on_complete(complete)`` once (``complete`` False: the client went away before the
    run's terminal frame was sent; a client that hangs up right after it had it all).
    """

    def __init__(self, run: Run, headers: dict[str, str], on_complete: Callable[[bool], None],
                 drain: float = 0.0) -> None:
        self.run = run
        self.headers = headers
        self.on_complete = on_complete
        #: seconds the answer is still read to its end after the client went (a managed key's
        #: ``on_disconnect: "drain"``: its usage then comes, for exact billing); 0: stop at once
        self.drain = drain
        self._complete = False
        self._gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.create_task(self._send_stream(send))
        listener = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
            if not sender.done() and self.drain > 0:
                self._gone = True  # nothing more is sent; the upstream is read to its usage
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.drain):
                        await asyncio.shield(sender)
            if not sender.done():
                sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        except asyncio.CancelledError:
            sender.cancel()
            raise
        except Exception as exc:  # writing failed in a way of ours: an error, not a disconnect
            if self.run.error is None:
                self.run.error = internal_error(exc, self.run.record.request_id, "send")
            self._complete = True
        finally:
            listener.cancel()
            self.on_complete(self._complete)  # decided after the sender stopped

    async def _send_stream(self, send: Send) -> None:
        record = self.run.record
        started = False
        async with contextlib.aclosing(self.run.stream()) as outputs:
            async for out in outputs:
                if isinstance(out, GatewayError):
                    await error_response(self.run.room, out, self.headers)(
                        {"type": "http"}, _no_receive, send
                    )
                    self._complete = True
                    return
                if not started:
                    started = True
                    record.ttfb_ms = round((time.time() - record.started_at) * 1000, 2)
                    raw_headers = [(k.encode(), v.encode()) for k, v in (SSE_HEADERS | self.headers).items()]
                    await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
                if out and not self._gone:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    if self.run.terminated:  # the whole answer is out: a client leaving now left after it
                        self._complete = True
        if self._gone:  # drained after the client left: its usage is in; the client has not all
            return
        if started:
            # the server waits here while the transport still holds what the client has not
            # taken: past it, the terminal was handed on (a rollout call's record is confirmed)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if self.run.terminated and self.run.error is None:
                self.run.released()
        self._complete = True


async def _no_receive() -> dict[str, Any]:
    """The receive of the error response sent in place of a stream (it reads no body)."""
    return {"type": "http.request", "body": b"", "more_body": False}


async def _wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the other side of the race with the stream)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
