"""vLLM's dev RL API in the simulator: pause, resume, abort and weight versions.

A trainer updates an engine's weights between ``POST /pause`` and ``POST /resume``. vLLM's
semantics (``vllm/entrypoints/serve/rlhf/api_router.py``, PROTOCOLS.md "Fleets and weight
updates"), reproduced here so the gateway's engine sync is tested against them:

- ``mode=abort`` (vLLM's default): every in-flight stream ends at once, after the tokens it
  already sent, with ``finish_reason: "abort"``; ``keep``: in-flight streams freeze before
  their next token until ``/resume`` (one answer can straddle two weight versions);
  ``wait``: in-flight streams finish, ``/pause`` answers once they have.
- In every mode, requests that arrive while paused wait (the engine's queue) until resume.
- ``/abort_requests`` ends the named requests (the ``X-Request-Id`` they came with) the same
  way an abort pause does, without pausing.
- ``/weight_info`` reports the weight version ("default" until a trainer sets one),
  ``/update_weight_version`` sets it.

A paused engine holds its queue for as long as it stays paused, as vLLM does: the client's
own timeout or hang-up (which cancels the waiting request) is the bound.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.simulator.scenarios import usage_of

PAUSE_MODES = ("abort", "wait", "keep")
DEFAULT_PAUSE_MODE = "abort"  # vLLM's default
DEFAULT_WEIGHT_VERSION = "default"


@dataclass(eq=False)
class Ticket:
    """One admitted generation request, as long as it streams."""

    request_id: str
    aborted: bool = False
    serial: int = 0
    #: chunks sent so far per kind of output (content, reasoning_content, tool_calls): for tests
    said: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineControl:
    """The engine's pause state, its in-flight requests and its weight version.

    Every state change wakes every waiter (``_changed`` is replaced each time); waiters
    re-check their own condition, so there is no lost wake-up and no per-waiter bookkeeping.
    """

    weight_version: str = DEFAULT_WEIGHT_VERSION
    paused_mode: str | None = None
    in_flight: dict[int, Ticket] = field(default_factory=dict)
    pauses: int = 0
    aborted: int = 0
    #: every id ``/abort_requests`` was asked to end, in order (in flight or not): for tests
    abort_requested: list[str] = field(default_factory=list)
    #: requests waiting to be admitted (while paused), as ``vllm:num_requests_waiting``
    waiting: int = 0
    #: ``POST /_sim/engine_load``: what /metrics reports on top (another client's queue), and its KV usage
    extra_waiting: int = 0
    kv_cache_usage: float = 0.0
    _serials: Any = field(default_factory=itertools.count)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def paused(self) -> bool:
        return self.paused_mode is not None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, condition: Any) -> None:
        while not condition():
            await self._changed.wait()

    async def admit(self, request_id: str) -> Ticket:
        """A new request: it waits while the engine is paused, then counts as in flight."""
        self.waiting += 1
        try:
            await self._until(lambda: not self.paused)
        finally:
            self.waiting -= 1
        ticket = Ticket(request_id, serial=next(self._serials))
        self.in_flight[ticket.serial] = ticket
        self._notify()
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The request's stream ended (finished, aborted, or its client hung up)."""
        if self.in_flight.pop(ticket.serial, None) is not None:
            self._notify()

    async def may_emit(self, ticket: Ticket) -> bool:
        """Before each token: frozen while a ``keep`` pause lasts; False once aborted."""
        await self._until(lambda: ticket.aborted or self.paused_mode != "keep")
        return not ticket.aborted

    async def pause(self, mode: str) -> None:
        """Pause in ``mode``; returns once in-flight requests are handled as the mode says."""
        self.paused_mode, self.pauses = mode, self.pauses + 1
        if mode == "abort":
            self._abort(list(self.in_flight.values()))
        self._notify()
        if mode == "wait":
            await self._until(lambda: not self.in_flight or self.paused_mode != "wait")

    def resume(self) -> None:
        self.paused_mode = None
        self._notify()

    def abort_requests(self, request_ids: list[str]) -> int:
        """End the in-flight requests with these ids; how many there were."""
        self.abort_requested += request_ids
        wanted = set(request_ids)
        hit = [t for t in self.in_flight.values() if t.request_id in wanted]
        self._abort(hit)
        self._notify()
        return len(hit)

    def _abort(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            if not ticket.aborted:
                ticket.aborted, self.aborted = True, self.aborted + 1


@dataclass
class StreamGate:
    """One chat stream's frames under the engine's pause state: asked before each frame,
    it remembers what went out so an abort can end the stream the way vLLM does."""

    engine: EngineControl
    ticket: Ticket
    body: dict[str, Any]
    sent: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False

    async def allows(self, frame: dict[str, Any]) -> bool:
        """Wait while a ``keep`` pause lasts; False once aborted (before the answer finished)."""
        if not self.finished and not await self.engine.may_emit(self.ticket):
            return False
        choices = frame.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        delta = choice.get("delta")
        self.sent.append(delta if isinstance(delta, dict) else {})
        for key in ("content", "reasoning_content", "reasoning", "tool_calls"):
            if isinstance(delta, dict) and delta.get(key):
                self.ticket.said[key] = self.ticket.said.get(key, 0) + 1
        if choice.get("text"):  # a token-in (/v1/completions) chunk
            self.ticket.said["text"] = self.ticket.said.get("text", 0) + 1
        self.finished = self.finished or bool(choice.get("finish_reason"))
        return True

    def abort_frames(self) -> list[dict[str, Any]]:
        """What ends an aborted stream: no more text, ``finish_reason: "abort"``, the usage
        of what was sent (when asked for), ``[DONE]``."""
        frames: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}]
        options = self.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            frames.append({"choices": [], "usage": usage_of(self.body, self.sent)})
        return frames + [{"_op": "done"}]


async def gated(engine: EngineControl, request_id: str, body: dict[str, Any],
                frames: Callable[[StreamGate], AsyncIterator[bytes]]) -> AsyncGenerator[bytes, None]:
    """A chat stream as the engine serves it: it waits in the queue while the engine is
    paused, then counts as in flight until it ends (``frames``: its bytes under the gate)."""
    ticket = await engine.admit(request_id)
    try:
        async for piece in frames(StreamGate(engine, ticket, body)):
            yield piece
    finally:
        engine.release(ticket)


def _control(request: Request) -> EngineControl:
    return request.app.state.engine  # type: ignore[no-any-return]


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def pause(request: Request) -> Response:
    mode = request.query_params.get("mode", DEFAULT_PAUSE_MODE)
    if mode not in PAUSE_MODES:
        return _error(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    await _control(request).pause(mode)
    return JSONResponse({"status": "paused"})


async def resume(request: Request) -> Response:
    _control(request).resume()
    return JSONResponse({"status": "resumed"})


async def is_paused(request: Request) -> Response:
    return JSONResponse({"is_paused": _control(request).paused})


async def _json_object(request: Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def abort_requests(request: Request) -> Response:
    body = await _json_object(request)
    ids = body.get("request_ids") if body else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return _error("'request_ids' must be a list of strings")
    return JSONResponse({"aborted": _control(request).abort_requests(ids)})


async def weight_info(request: Request) -> Response:
    return JSONResponse({"weight_version": _control(request).weight_version})


async def update_weight_version(request: Request) -> Response:
    body = await _json_object(request)
    version = body.get("weight_version") if body else None
    if not isinstance(version, str) or not version:
        return _error("'weight_version' must be a non-empty string")
    _control(request).weight_version = version
    return JSONResponse({"weight_version": version})


async def engine_stats(request: Request) -> Response:
    """The simulator's own view (not vLLM's API): for tests."""
    control = _control(request)
    return JSONResponse({"paused_mode": control.paused_mode, "in_flight": len(control.in_flight),
                         "pauses": control.pauses, "aborted": control.aborted,
                         "weight_version": control.weight_version,
                         "abort_requested": control.abort_requested,
                         "said": [dict(t.said) for t in control.in_flight.values()]})


async def metrics(request: Request) -> Response:
    """vLLM's load gauges, as its ``/metrics`` names them (Prometheus text)."""
    control = _control(request)
    lines = []
    for name, value in (("vllm:num_requests_running", len(control.in_flight)),
                        ("vllm:num_requests_waiting", control.waiting + control.extra_waiting),
                        ("vllm:kv_cache_usage_perc", control.kv_cache_usage)):
        lines += [f"# TYPE {name} gauge", f'{name}{{engine="0",model_name="simulator"}} {float(value)}']
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


async def set_engine_load(request: Request) -> Response:
    """``POST {"waiting": n, "kv_cache_usage": x}``: the queue and KV usage /metrics adds
    to its own (as if another client loaded this engine); for tests and benchmarks."""
    body = await _json_object(request)
    waiting = body.get("waiting", 0) if body else None
    usage = body.get("kv_cache_usage", 0.0) if body else None
    if not isinstance(waiting, int) or waiting < 0 or not isinstance(usage, int | float) or not 0 <= usage <= 1:
        return _error("'waiting' must be an integer >= 0 and 'kv_cache_usage' a number from 0 to 1")
    control = _control(request)
    control.extra_waiting, control.kv_cache_usage = waiting, float(usage)
    return JSONResponse({"waiting": waiting, "kv_cache_usage": float(usage)})


ROUTES = [
    Route("/pause", pause, methods=["POST"]),
    Route("/resume", resume, methods=["POST"]),
    Route("/is_paused", is_paused, methods=["GET"]),
    Route("/abort_requests", abort_requests, methods=["POST"]),
    Route("/weight_info", weight_info, methods=["GET"]),
    Route("/update_weight_version", update_weight_version, methods=["POST"]),
    Route("/_sim/engine", engine_stats, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/_sim/engine_load", set_engine_load, methods=["POST"]),
]
