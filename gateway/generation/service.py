"""The one place that wires a generation request: its admission (client key, limits,
body, parse, reservation, capacity: :mod:`gateway.generation.admission`), then a
:class:`~gateway.generation.run.GenerationRun` answered as JSON or as a stream. Every way
out goes through one :class:`~gateway.generation.outcome.RequestOutcome`, which writes the
outcome and reports the record exactly once.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.background import BackgroundTask
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response

from gateway.engines.fleet import EngineFleet
from gateway.errors import GatewayError
from gateway.generation.admission import Admitted, RequestAdmission, name_key
from gateway.generation.body_parsing import BodyBudget
from gateway.generation.outcome import RequestOutcome, internal_error
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestObserver, RequestRecord
from gateway.generation.response import GenerationResponse, error_response
from gateway.generation.run import GenerationRun, Run, RunningGenerations, capture_record, note_run
from gateway.keys.identity import check_client_key, client_identity
from gateway.keys.limiter import Arrived, KeyLimiter
from gateway.keys.registry import KeyRegistry
from gateway.live_settings import LiveSettings
from gateway.protocols.base import ProtocolRoom
from gateway.protocols.envelope import PROCESS_KEYRING, Keyring, Tenant
from gateway.rollout.capture_files import CaptureWriter
from gateway.upstream.attempts import UpstreamAttempts
from gateway.upstream.client import UpstreamClient
from gateway.upstream.pool import UpstreamPool

#: The scope key under which a generation request keeps its upstream attempts, for the
#: ``x-codebuddy2api-upstream`` header (app.SimulatorHeader reads it at the status line).
ATTEMPTS_SCOPE_KEY = "codebuddy2api.attempts"

if TYPE_CHECKING:
    from gateway.rollout.recorder import RolloutRecorder
    from gateway.store.replicas import CapacityPolicy


class GenerationService:
    """Wires generation requests for every protocol room (it does not relay bytes itself:
    :class:`~gateway.generation.run.GenerationRun` does)."""

    def __init__(self, live: LiveSettings, upstream: UpstreamClient, observer: RequestObserver) -> None:
        self.live = live
        self.upstream = upstream
        self.observer = observer
        self.pool: UpstreamPool = UpstreamPool([])  # replaced at start-up (app lifespan)
        self.capture: CaptureWriter | None = None  # set at start-up with --capture-dir
        self.rollouts: RolloutRecorder | None = None  # rollout call records (set at start-up)
        #: With replicas on a shared store: this replica's share of max_concurrent
        #: (gateway.store.replicas.SharedCapacity); None = the whole cap is local.
        self.capacity: CapacityPolicy | None = None
        #: the generations holding a capacity slot now; ``running.abort_all(err)`` ends them
        self.running = RunningGenerations()
        #: raises 503 recording_unavailable while no record can be kept (gateway/generation/recording_gate.py)
        self.recording: Callable[[], None] | None = None
        #: request-body bytes held by requests now (--max-body-bytes-in-flight)
        self.bodies = BodyBudget(live.current.max_body_bytes_in_flight)
        #: the envelope keyring now (the store's EnvelopeKeys, set at start-up)
        self.envelope_keys: Callable[[], Keyring] = lambda: PROCESS_KEYRING
        #: managed client keys (gateway/keys/): who may ask, and their reservations
        self.keys: KeyRegistry | None = None
        self.limiter: KeyLimiter | None = None
        #: weight sync (gateway/engines/; set at start-up): new calls to engines wait in its
        #: hold while they are paused, aborted chat answers are continued
        self.engines: EngineFleet | None = None

    def tenant(self, request: HTTPConnection) -> Tenant:
        """The tenant of a request whose client key was checked."""
        return Tenant(client_identity(request, self.live.current.api_key), self.envelope_keys)

    @property
    def in_flight(self) -> int:
        """Generation requests holding a capacity slot right now."""
        return len(self.running)

    def in_flight_by(self, dimension: str) -> dict[str, int]:
        """Requests holding a slot now, counted by ``protocol`` or by ``mode``."""
        counts: dict[str, int] = {}
        for run in self.running:
            key = run.record.protocol if dimension == "protocol" else run.record.mode
            counts[key] = counts.get(key, 0) + 1
        return counts

    async def handle(
        self, room: ProtocolRoom, request: Request, transport: str = "http"
    ) -> Response | GenerationResponse:
        """``transport``: how the request came (``websocket``: a Responses WebSocket frame)."""
        settings = self.live.current
        policy = StreamPolicy.snapshot(settings)
        record = _open_record(room, transport, policy)
        record.traceparent = (request.headers.get("traceparent") or "")[:128] or None
        self.observer.on_start(record)
        headers = {"x-request-id": record.request_id, "x-codebuddy2api-stream-mode": policy.mode.value}
        run: GenerationRun | None = None
        admission = RequestAdmission(self, room, request, record, headers)
        outcome = RequestOutcome(record, lambda: self._report(record, run, admission.held))
        admitted = await admission.admit(outcome, settings, policy)
        if not isinstance(admitted, Admitted):
            return admitted  # refused: answered in the room's shape, its outcome written
        parsed, key, rollout = admitted.parsed, admitted.key, admitted.rollout
        session_id = rollout or (request.headers.get(settings.session_header) if settings.session_header else None)
        # a session's calls stay on one replica (its prefix cache): gateway/upstream/routing.py
        session = None if session_id is None else ("rollout:" + session_id if rollout else session_id)
        upstream_headers = ({settings.upstream_session_header: session_id}
                            if settings.upstream_session_header and _sendable_header(session_id) else None)
        try:
            # a room may name its own run: the relayed routes' RelayedCall (gateway/generation/passthrough.py)
            run_type = getattr(room, "run_type", GenerationRun)
            attempts = UpstreamAttempts(self.pool, self.upstream, policy, session, record.trace_context,
                                        admitted.token_in, upstream_headers, self.engines, record.request_id)
            run = run_type(room, parsed, policy, record, attempts)
        except Exception as exc:
            err = internal_error(exc, record.request_id, "encoder")
            outcome.failed(err)
            return error_response(room, err, headers)
        run.rollout_id, run.rollout_group = rollout, admitted.group
        request.scope[ATTEMPTS_SCOPE_KEY] = run.attempts  # the x-codebuddy2api-upstream header (app.SimulatorHeader)
        if admitted.recording:
            run.before_release = self.rollouts.commit  # type: ignore[union-attr]
            run.after_release = self.rollouts.released  # type: ignore[union-attr]
        self.running.add(run)
        if parsed.stream:  # a key that bills exactly reads the answer to its usage after a hang-up
            drain = settings.attempt_timeout if key is not None and key.limits.on_disconnect == "drain" else 0.0
            return GenerationResponse(run, headers, lambda complete: _stream_outcome(outcome, run, complete), drain)
        return await _answer_json(room, run, outcome, headers)

    def refuse_unread(
        self, room: ProtocolRoom, error: GatewayError, transport: str, client: HTTPConnection, invalid: bool = True
    ) -> GatewayError:
        """A request refused before it could be read as one (a WebSocket frame that is not
        JSON, too large, or past the queue bound; ``invalid`` False: one that arrived while
        the gateway drains): still its one audit record, as the same
        body over HTTP has, and the client key checked first as there (without one the
        answer is the 401, not what was wrong with the frame). Returns the error to send."""
        settings = self.live.current
        record = _open_record(room, transport, StreamPolicy.snapshot(settings))
        self.observer.on_start(record)
        outcome = RequestOutcome(record, lambda: self._report(record, None))
        try:
            record.client_key_fingerprint = check_client_key(client, settings.api_key, self.keys)
        except GatewayError as refused:
            name_key(record, client)
            outcome.refused(refused)
            return refused
        name_key(record, client)
        if invalid:
            outcome.invalid(error)
        else:  # refused for the gateway's own reason (shutting down), not the frame's
            outcome.refused(error)
        return error

    def _report(self, record: RequestRecord, run: GenerationRun | None, held: int = 0) -> None:
        """The single exit of every generation request (called once, by its
        RequestOutcome): frees its slot and its body bytes, completes the record, reports it."""
        self.running.discard(record.request_id)
        self.bodies.release(held)
        record.ended_at = time.time()
        record.duration_ms = (record.ended_at - record.started_at) * 1000
        chat_run = run if isinstance(run, GenerationRun) else None  # a RelayedCall noted itself
        if chat_run is not None:
            note_run(record, chat_run)
        if record.key_id and self.limiter is not None and self.keys is not None:
            # settles its reservation (a task: no wait), also for a key deleted meanwhile
            self.limiter.finished(self.keys.get(record.key_id), record, _arrived(chat_run))
        self.observer.on_finish(record)
        if self.capture is not None and chat_run is not None:
            self.capture.submit(capture_record(chat_run))
        if self.rollouts is not None and chat_run is not None:
            self.rollouts.finished(chat_run, record.outcome, record.error_code)


def _arrived(run: GenerationRun | None) -> Arrived | None:
    """What the upstream produced for the run, for a request that ends without usage (a
    cancelled or cut stream is charged this: keys/limiter.py). References, not copies: the
    run is over, and the counting happens in a worker thread."""
    if run is None:
        return None
    acc = run.answer.acc
    if not any(a.get("status") == 200 for a in run.attempts.log) or acc is None:
        return Arrived()  # the upstream never answered: it generated nothing
    reported = acc.usage.total_tokens if acc.usage is not None and not acc.usage_estimated else 0
    body = run.answer.bodies[-1] if run.answer.bodies else run.upstream_body
    return Arrived(reported, body, acc.arrived())


def _open_record(room: ProtocolRoom, transport: str, policy: StreamPolicy) -> RequestRecord:
    """A request's audit record, opened before anything about it is checked."""
    return RequestRecord(
        request_id="req_" + secrets.token_hex(12), protocol=room.name, started_at=time.time(),
        transport=transport, mode=policy.mode.value,
    )


async def _answer_json(
    room: ProtocolRoom, run: GenerationRun, outcome: RequestOutcome, headers: dict[str, str]
) -> Response:
    """A non-streamed request's answer: the run collected into the room's JSON body."""
    try:
        completion = await run.collect()
        await room.completed(run.parsed, run.response_id, completion, None)
        body = room.json_body(run.parsed, run.response_id, completion)
    except GatewayError as err:
        run.error = err
    except asyncio.CancelledError:
        outcome.cancelled()
        raise
    except Exception as exc:  # a bug of ours: the room's 500, audited as an error
        run.error = internal_error(exc, run.record.request_id, "json")
    if run.error is not None:
        outcome.failed(run.error)
        return error_response(room, run.error, headers)
    outcome.succeeded()
    # the body handed to the transport: a rollout call's record is confirmed delivered
    return JSONResponse(body, headers=headers, background=BackgroundTask(_released, run))


def _sendable_header(value: str | None) -> bool:
    """A session id that can go upstream as a header value as it is (printable ASCII,
    1 to 512 characters); any other is not sent (a routing hint, never a 500)."""
    return bool(value) and len(value) <= 512 and value.isascii() and value.isprintable()  # type: ignore[arg-type,union-attr]


async def _released(run: GenerationRun) -> None:
    run.released()


def _stream_outcome(outcome: RequestOutcome, run: Run, complete: bool) -> None:
    """How a streamed request ended, decided once after its response stopped."""
    if not complete:
        outcome.cancelled()
    elif run.error is not None:
        outcome.failed(run.error, committed=run.committed)
    else:
        outcome.succeeded()
