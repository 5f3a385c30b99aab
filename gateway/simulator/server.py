"""Scripted OpenAI-compatible Chat Completions upstream served over real HTTP.

The gateway, its tests and its benchmarks point at this simulator instead of a real
provider. Scenarios (``sim_scenarios``) are pure functions producing *frames*; this module
only replays frames over HTTP, records what it was sent, and counts streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.simulator import completions as sim_completions
from gateway.simulator import engine_control
from gateway.simulator import prefill as sim_prefill
from gateway.simulator import token_in as sim_token_in
from gateway.simulator.engine_control import EngineControl, StreamGate
from gateway.simulator.reply import (  # noqa: F401  (re-exported for tests and tools)
    DEFAULT_TOOLS,
    GREETING,
    REASONING,
    TEXT,
    TOOL_ARGS,
    Frame,
    Options,
    parse_model,
)
from gateway.simulator.scenarios import (  # noqa: F401  (re-exported for tests and tools)
    ERROR_FRAME,
    SCENARIOS,
    Plan,
    ScriptSpec,
    assemble_completion,
    build_frames,
    build_plan,
    error_body,
    scenario_names,
    token_id,
)
from gateway.upstream.credential import fingerprint

REQUEST_LOG_SIZE = 500
#: The context window the simulator lists for every model (vLLM's `max_model_len` field).
MAX_MODEL_LEN = 32768


class SimulatedDrop(Exception):
    """Raised inside a body iterator so uvicorn aborts the connection mid-response."""


@dataclass
class Stamp:
    """Per-response chunk envelope (id/object/created/model) filled in at send time."""

    model: str
    unstable: bool = False
    base_id: str = field(default_factory=lambda: f"chatcmpl-sim-{uuid.uuid4().hex[:16]}")
    created: int = field(default_factory=lambda: int(time.time()))
    count: int = 0

    def apply(self, frame: Frame) -> Frame:
        if "_op" in frame or "error" in frame:
            return frame
        chunk_id = f"{self.base_id}-{self.count}" if self.unstable else self.base_id
        self.count += 1
        envelope = {"id": chunk_id, "object": "chat.completion.chunk",
                    "created": self.created, "model": self.model}
        return {**envelope, **frame}


#: Seconds a ``pause_at`` stream stalls mid-answer.
PAUSE_SECONDS = 60.0


@dataclass
class Stats:
    """Stream lifecycle counters; lets tests prove cancellation reached the upstream."""

    open_streams: int = 0
    completed: int = 0
    cancelled: int = 0
    dropped: int = 0
    #: bytes of stream bodies handed to the server so far (what a stalled reader let through)
    bytes_sent: int = 0
    last_cancel_at: float | None = None
    #: the usage of the last frame sent that carried one (with ``usage=running``: what the
    #: stream had generated when it ended, cancelled or not)
    last_sent_usage: dict[str, Any] | None = None


@dataclass
class SimState:
    """The app's only mutable state (kept on ``app.state.sim``)."""

    scripts: dict[str, ScriptSpec] = field(default_factory=dict)
    fault_model: str | None = None  # when set, every chat request is served as this model
    fault_left: int | None = None  # requests the fault still applies to (None: until healed)
    requests: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=REQUEST_LOG_SIZE))
    stats: Stats = field(default_factory=Stats)


def _sse_bytes(frame: Frame, stamp: Stamp) -> bytes:
    op = frame.get("_op")
    if op == "done":
        return b"data: [DONE]\n\n"
    data = str(frame.get("data", "")) if op == "raw" else json.dumps(stamp.apply(frame))
    return f"data: {data}\n\n".encode()


async def _sse(plan: Plan, stamp: Stamp, stats: Stats | None = None,
               gate: StreamGate | None = None) -> AsyncGenerator[bytes, None]:
    """Yield one SSE event per frame, honouring delays so each frame is flushed separately;
    with a ``gate``, under the engine's pause state (engine_control)."""
    if plan.options.first_chunk_delay > 0:
        await asyncio.sleep(plan.options.first_chunk_delay)
    pause_at = int(len(plan.frames) * plan.options.pause_at) if 0 < plan.options.pause_at < 1 else -1
    for n, frame in enumerate(plan.frames):
        if n and plan.options.delay > 0:
            await asyncio.sleep(plan.options.delay)
        if n == pause_at:  # a stream caught mid-answer, until the reader gives up on it
            await asyncio.sleep(PAUSE_SECONDS)
        op = frame.get("_op")
        if op == "sleep":
            await asyncio.sleep(float(frame.get("seconds", 0)))
        elif op == "drop":
            raise SimulatedDrop("simulated connection drop")
        elif gate is not None and not await gate.allows(frame):
            for end in gate.abort_frames():
                yield _sse_bytes(end, stamp)
            return
        else:
            yield _sse_bytes(frame, stamp)
            if stats is not None and isinstance(frame.get("usage"), dict):
                stats.last_sent_usage = frame["usage"]


async def _truncated(payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
    """Half a JSON body, then an abort: the non-streaming flavour of ``drop``."""
    raw = json.dumps(payload).encode()
    yield raw[: len(raw) // 2]
    raise SimulatedDrop("simulated connection drop")


async def _tracked(stats: Stats, body: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """Count open/completed/cancelled streams; 'cancelled' means the body never ran to the end."""
    stats.open_streams += 1
    outcome = "cancelled"
    try:
        async for piece in body:
            yield piece
            stats.bytes_sent += len(piece)
        outcome = "completed"
    except SimulatedDrop:
        outcome = "dropped"
        raise
    finally:
        stats.open_streams -= 1
        if outcome == "cancelled":
            stats.cancelled += 1
            stats.last_cancel_at = time.monotonic()
        elif outcome == "completed":
            stats.completed += 1
        else:
            stats.dropped += 1
        await body.aclose()


class ClosingStreamingResponse(StreamingResponse):
    """Always aclose() the body so accounting runs even when Starlette abandons it on disconnect."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _sim(request: Request) -> SimState:
    return request.app.state.sim  # type: ignore[no-any-return]


def _engine(request: Request) -> EngineControl:
    return request.app.state.engine  # type: ignore[no-any-return]


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"null")
    except ValueError:
        return None


def _log_request(request: Request, body: Any) -> None:
    """Record what the gateway forwarded; never the Authorization value itself."""
    auth = request.headers.get("authorization", "")
    _sim(request).requests.append({
        "body": body, "has_authorization": bool(auth),
        "key_fingerprint": fingerprint(auth[7:]) if auth.lower().startswith("bearer ") else None,
        "headers": {k: v for k, v in request.headers.items()
                    if k.startswith("x-") or k in ("traceparent", "content-type")},
        "path": request.url.path, "at": time.monotonic(),
    })


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error", None), status_code=400)


def _with_usage(body: dict[str, Any]) -> dict[str, Any]:
    """Non-streaming responses always report usage, as real upstreams do."""
    extra = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    return {**body, "stream_options": {**extra, "include_usage": True}}


async def _non_stream(plan: Plan, stamp: Stamp, stats: Stats) -> Response:
    wait = plan.options.first_chunk_delay + sum(
        float(f.get("seconds", 0)) for f in plan.frames if f.get("_op") == "sleep"
    )
    if wait > 0:
        await asyncio.sleep(wait)
    frames = [stamp.apply(f) for f in plan.frames]
    error = next((f for f in frames if "error" in f and "_op" not in f), None)
    if error is not None:
        return JSONResponse(error, status_code=500, headers=plan.headers)
    completion = assemble_completion(frames, stamp.model)
    if any(f.get("_op") == "drop" for f in frames):
        body = _tracked(stats, _truncated(completion))
        return ClosingStreamingResponse(body, media_type="application/json", headers=plan.headers)
    return JSONResponse(completion, headers=plan.headers)


async def chat_completions(request: Request) -> Response:
    body = await _json_body(request)
    _log_request(request, body)
    if not isinstance(body, dict):
        return _bad_request("request body must be a JSON object")
    model = _take_fault(_sim(request)) or str(body.get("model") or "echo")
    stream = body.get("stream") is True
    try:
        plan = build_plan(model, body if stream else _with_usage(body), _sim(request).scripts,
                          request.headers.get("authorization", ""))
    except ValueError as exc:
        return _bad_request(str(exc))
    refused = sim_prefill.refusal(body)
    if refused is not None:
        return _bad_request(refused)
    prefill = sim_prefill.prefill_of(body)
    if prefill is not None and plan.status == 200:
        plan = dataclasses.replace(plan, frames=sim_prefill.continued(plan.frames, prefill))
    if plan.options.ttfb > 0:
        await asyncio.sleep(plan.options.ttfb)
    if plan.status != 200:
        return JSONResponse(plan.frames[0], status_code=plan.status, headers=plan.headers)
    if plan.raw is not None:
        media_type, content = plan.raw
        return Response(content, media_type=media_type, headers=plan.headers)
    stamp = Stamp(model, plan.options.unstable_id)
    engine, request_id = _engine(request), request.headers.get("x-request-id") or stamp.base_id
    if not stream:
        ticket = await engine.admit(request_id)  # waits while paused; no mid-answer freeze or abort
        try:
            return await _non_stream(plan, stamp, _sim(request).stats)
        finally:
            engine.release(ticket)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **plan.headers}
    body_iter = _tracked(_sim(request).stats, engine_control.gated(
        engine, request_id, body, lambda gate: _sse(plan, stamp, _sim(request).stats, gate)))
    return ClosingStreamingResponse(body_iter, media_type="text/event-stream", headers=headers)


def _take_fault(state: SimState) -> str | None:
    """The fault scenario for this request, if one is set (counting it down)."""
    if state.fault_model is None:
        return None
    model = state.fault_model
    if state.fault_left is not None:
        state.fault_left -= 1
        if state.fault_left <= 0:
            state.fault_model = state.fault_left = None
    return model


async def fault(request: Request) -> Response:
    """``POST {"model": "server_error"}`` makes this instance fail every chat request the
    way that scenario does (to test failover between instances); ``DELETE`` heals it.
    ``"count": n`` heals it by itself after n requests. An error scenario (``unauthorized``:
    a revoked key) also answers ``GET /v1/models`` (what credential probes call)."""
    state = _sim(request)
    if request.method == "DELETE":
        state.fault_model = state.fault_left = None
    else:
        payload = await _json_body(request)
        model = payload.get("model") if isinstance(payload, dict) else None
        count = payload.get("count") if isinstance(payload, dict) else None
        if not isinstance(model, str) or not model:
            return _bad_request("'model' must be a scenario string")
        if count is not None and (not isinstance(count, int) or count < 1):
            return _bad_request("'count' must be a positive integer")
        state.fault_model, state.fault_left = model, count
    return JSONResponse({"fault_model": state.fault_model, "fault_left": state.fault_left})


async def list_models(request: Request) -> Response:
    _log_request(request, None)
    state = _sim(request)
    if state.fault_model is not None:
        plan = build_plan(state.fault_model, {}, state.scripts)
        if plan.status != 200:  # an error fault: the models list fails the same way
            _take_fault(state)
            return JSONResponse(plan.frames[0], status_code=plan.status, headers=plan.headers)
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "simulator", "max_model_len": MAX_MODEL_LEN}
            for n in scenario_names()]  # max_model_len: as vLLM lists it (the gateway's /v1/models reads it)
    return JSONResponse({"object": "list", "data": data})


async def register_script(request: Request) -> Response:
    payload = await _json_body(request)
    frames = payload.get("frames") if isinstance(payload, dict) else None
    if not isinstance(frames, list) or not all(isinstance(f, dict) for f in frames):
        return _bad_request("'frames' must be a list of objects")
    headers, status = payload.get("headers") or {}, payload.get("status", 200)
    if not isinstance(headers, dict) or not isinstance(status, int):
        return _bad_request("'headers' must be an object and 'status' an integer")
    script_id = uuid.uuid4().hex[:12]
    plain = {str(k): str(v) for k, v in headers.items()}
    _sim(request).scripts[script_id] = ScriptSpec(frames, status, plain)
    return JSONResponse({"id": script_id})


async def recorded_requests(request: Request) -> Response:
    log = _sim(request).requests
    if request.method == "DELETE":
        log.clear()
        return JSONResponse({"cleared": True})
    return JSONResponse({"requests": list(log)})


async def stats(request: Request) -> Response:
    return JSONResponse(dataclasses.asdict(_sim(request).stats))


async def healthz(request: Request) -> Response:
    return JSONResponse({"ok": True})


class _HideDeliberateDrops(logging.Filter):
    """Drops are the scenario, not a bug: keep uvicorn from logging their tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, SimulatedDrop)


async def _relayed_body(request: Request, required: str, named: str) -> dict[str, Any] | Response:
    """The opening the relayed routes share: the JSON body (logged), a 400 without
    ``required`` (``named``: how the message names it), the scripted 500 for the error
    model; else the body."""
    body = await _json_body(request)
    _log_request(request, body)
    if not isinstance(body, dict) or required not in body:
        return _bad_request(f"request body must be a JSON object with {named}")
    if body.get("model") == sim_completions.COMPLETION_MODEL_ERROR:
        return JSONResponse(error_body("simulated server error", "server_error", None), status_code=500)
    return body


def _delay_of(body: dict[str, Any]) -> float:
    try:
        return parse_model(str(body.get("model") or "")).delay
    except ValueError:
        return 0.0


async def _gated_completion(chunks: list[dict[str, Any]], delay: float, gate: StreamGate) -> AsyncIterator[bytes]:
    """A token-in answer under the engine's pause state, ``delay`` (the model's option)
    between chunks: frozen by ``keep``, ended by an abort with ``finish_reason: "abort"``."""
    for n, chunk in enumerate(chunks):
        if n and delay > 0:
            await asyncio.sleep(delay)
        if not await gate.allows(chunk):
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'abort'}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _completion_stream(chunks: list[dict[str, Any]]) -> StreamingResponse:
    frames = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
    return StreamingResponse(iter(frames), media_type="text/event-stream")


async def text_completions(request: Request) -> Response:
    """``/v1/completions`` (legacy text completions; sim_completions says what it answers;
    vLLM's token-in continuation, sim_token_in)."""
    body = await _relayed_body(request, "prompt", "a prompt")
    if isinstance(body, Response):
        return body
    answer_id, created = "cmpl-sim" + uuid.uuid4().hex[:12], int(time.time())
    engine = _engine(request)
    if sim_token_in.is_token_in(body) and body.get("stream") is True:  # vLLM token-in (a rollout continuation)
        chunks = sim_token_in.completion_chunks(body, answer_id, created)
        request_id = request.headers.get("x-request-id") or answer_id
        return StreamingResponse(engine_control.gated(engine, request_id, body, lambda gate: _gated_completion(
            chunks, _delay_of(body), gate)), media_type="text/event-stream")
    engine.release(await engine.admit(answer_id))  # waits while paused (no mid-answer freeze here)
    if body.get("stream") is not True:
        return JSONResponse(sim_completions.completion_answer(body, answer_id, created))
    return _completion_stream(sim_completions.completion_chunks(body, answer_id, created))


async def tokenize(request: Request) -> Response:
    """vLLM's ``/tokenize`` (sim_token_in)."""
    body = await _json_body(request)
    _log_request(request, body)
    if not isinstance(body, dict):
        return _bad_request("request body must be a JSON object")
    return JSONResponse(sim_token_in.tokenize(body))


async def embeddings(request: Request) -> Response:
    """``/v1/embeddings``: deterministic vectors (sim_completions)."""
    body = await _relayed_body(request, "input", "an input")
    if isinstance(body, Response):
        return body
    return JSONResponse(sim_completions.embeddings_answer(body))


def _quiet_deliberate_drops() -> None:
    """Idempotently attach the drop filter to uvicorn's error logger (whoever runs the app)."""
    error_logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _HideDeliberateDrops) for f in error_logger.filters):
        error_logger.addFilter(_HideDeliberateDrops())


def create_simulator_app() -> Starlette:
    """Build a fresh simulator app with its own isolated state."""
    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/_sim/scripts", register_script, methods=["POST"]),
        Route("/_sim/requests", recorded_requests, methods=["GET", "DELETE"]),
        Route("/_sim/stats", stats, methods=["GET"]),
        Route("/_sim/fault", fault, methods=["POST", "DELETE"]),
        Route("/healthz", healthz, methods=["GET"]),
        *engine_control.ROUTES,
    ])
    app.state.sim = SimState()
    app.state.engine = EngineControl()
    _quiet_deliberate_drops()
    return app


def make_simulator_server(host: str = "127.0.0.1", port: int = 0) -> uvicorn.Server:
    """A configured (not yet started) uvicorn server; port 0 picks a free port."""
    config = uvicorn.Config(create_simulator_app(), host=host, port=port, log_level="warning")
    return uvicorn.Server(config)


async def serve_simulator(host: str, port: int) -> None:
    """Serve the simulator until cancelled or signalled."""
    await make_simulator_server(host, port).serve()


def run_simulator(host: str = "127.0.0.1", port: int = 8001, announce: bool = False) -> None:
    """Blocking entry point for scripts and benchmarks; ``announce`` says where it listens."""
    if announce:
        import sys

        print(f"codebuddy2api simulator listening on http://{host}:{port}/v1 (scripted answers; "
              f"the model name picks a scenario, e.g. text, tool, reasoning)", file=sys.stderr, flush=True)
    asyncio.run(serve_simulator(host, port))


if __name__ == "__main__":
    run_simulator()
