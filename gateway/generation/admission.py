"""A generation request's way in: everything before its run starts.

From the headers, before a byte of the body is read: a web page's request, the client key,
a managed key's share of the slots and its full rpm window, the recording gate, the body
bytes held in flight; then the body, parsed (off the loop when large) and resolved, a
rollout call's owner, frozen check and token-in plan; a managed key's models and
reservation; its share again and the capacity slot. Each refusal is answered in the room's
error shape with its outcome written (one audit record); what is let in is an
:class:`Admitted`, which :class:`~gateway.generation.service.GenerationService` turns into
a run. Apart from the service so the checks read in their order, away from the wiring of
the run and its report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import Response

from gateway.errors import ErrorCode, GatewayError
from gateway.generation.body_parsing import BodyBudget, parse_request
from gateway.generation.outcome import RequestOutcome, internal_error
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestRecord
from gateway.generation.response import error_response
from gateway.generation.run import RunningGenerations
from gateway.http.body_limit import BodyTooLarge
from gateway.http.cross_site import raise_refusal
from gateway.keys.identity import check_client_key
from gateway.keys.limiter import KeyLimiter, KeyRefusal, key_share_cap
from gateway.keys.model import ManagedKey
from gateway.keys.registry import KeyRegistry, managed_key, named_key
from gateway.protocols.base import ParsedRequest, ProtocolRoom
from gateway.protocols.envelope import Tenant
from gateway.rollout.chain import continuation
from gateway.rollout.ids import rollout_group_of, rollout_of
from gateway.rollout.tokens import with_token_fields
from gateway.settings import Settings
from gateway.upstream.client import UpstreamClient
from gateway.upstream.token_in import TokenIn

if TYPE_CHECKING:
    from gateway.rollout.recorder import RolloutRecorder
    from gateway.store.replicas import CapacityPolicy


class AdmissionParts(Protocol):
    """The long-lived parts admission reads (the service's, set at start-up)."""

    upstream: UpstreamClient
    running: RunningGenerations
    bodies: BodyBudget
    keys: KeyRegistry | None
    limiter: KeyLimiter | None
    recording: Callable[[], None] | None
    capacity: CapacityPolicy | None
    rollouts: RolloutRecorder | None

    def tenant(self, request: HTTPConnection) -> Tenant: ...


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request let in: what its run is built from."""

    parsed: ParsedRequest
    key: ManagedKey | None  # the managed key it came with
    rollout: str | None
    group: str | None  # its x-rollout-group header
    token_in: TokenIn | None
    recording: bool  # a recorded rollout call: its record is committed before the terminal


class RequestAdmission:
    """One request's checks before its run, in order; each refusal written to its
    ``outcome`` and answered. Holds the body bytes reserved for it (``held``) until its
    report releases them."""

    def __init__(self, parts: AdmissionParts, room: ProtocolRoom, request: Request, record: RequestRecord,
                 headers: dict[str, str]) -> None:
        self.parts = parts
        self.room = room
        self.request = request
        self.record = record
        self.headers = headers  # the answer's headers: a key's x-ratelimit-* are added here
        self.held = 0  # body bytes this request holds in the budget, released with its report

    async def admit(self, outcome: RequestOutcome, settings: Settings, policy: StreamPolicy) -> Admitted | Response:
        """The request let in, or the answer to its refusal (its outcome written)."""
        room, request, record, headers = self.room, self.request, self.record, self.headers
        try:  # from the headers, before a byte of the body is read
            raise_refusal(request.scope)  # a web page's request (gateway/http/cross_site.py)
            record.client_key_fingerprint = check_client_key(request, settings.api_key, self.parts.keys)
            key = managed_key(request)
            name_key(record, request)
            if key is not None:  # one key's flood is refused here, before it costs a parse
                self._check_share(key.key_id, settings.max_concurrent, settings.key_share)
                if self.parts.limiter is not None:  # a full rpm window: without the store (keys/full_windows.py)
                    await self.parts.limiter.refuse_full(key)
            if self.parts.recording is not None:
                self.parts.recording()
            self.held = self._hold_body(_declared_length(request), settings.max_body_bytes_in_flight)
            tenant = self.parts.tenant(request)
            body = await request.body()
            if not self.held:  # no Content-Length: what was read
                self.held = self._hold_body(len(body), settings.max_body_bytes_in_flight)
        except GatewayError as err:
            name_key(record, request)
            if isinstance(err, KeyRefusal):
                headers.update(err.headers)
            outcome.refused(err)
            await skip_small_body(request)
            return error_response(room, err, headers)
        except BodyTooLarge as exc:
            err = exc.error()
            outcome.invalid(err)
            return error_response(room, err, headers)
        except ClientDisconnect:
            outcome.cancelled(http_status=499)
            return Response(status_code=499)
        if settings.audit_bodies:
            record.bodies = {"request": body.decode("utf-8", "replace")}
        try:
            parsed = await parse_request(room, body, dict(request.query_params), tenant)  # off the loop when large
            record.model = parsed.model
            record.upstream_model = str(parsed.upstream_body.get("model", parsed.model))
            record.streamed = parsed.stream
            parsed = await room.resolve(parsed)
            rollout = rollout_of(request.scope, request.headers, settings.rollout_header)
            group = rollout_group_of(request.headers) if rollout is not None else None
            chat_room = getattr(room, "run_type", None) is None  # the relayed routes have no chat answer to record
            rollouts = self.parts.rollouts
            recording = chat_room and rollout is not None and rollouts is not None and rollouts.enabled
            token_in = None
            if recording:
                token_in = await _rollout_token_in(rollouts, rollout, parsed, self.parts.upstream, tenant.identity)  # type: ignore[arg-type]
            if chat_room and settings.capture_tokens != "none":
                tokens_body = with_token_fields(parsed.upstream_body, settings.capture_tokens)
                parsed = dataclasses.replace(parsed, upstream_body=tokens_body)
        except GatewayError as err:  # a 503 (stored state unreadable now) is no fault of the request
            (outcome.refused if err.kind == "overloaded" else outcome.invalid)(err)
            return error_response(room, err, headers)
        except Exception as exc:  # a bug of ours (parser, tokenizer, store): a 500, not a traceback
            err = internal_error(exc, record.request_id, "parse")
            outcome.failed(err)
            return error_response(room, err, headers)
        if key is not None and self.parts.limiter is not None:
            try:  # its models, then a reservation in the store (before anything goes upstream)
                admission = await self.parts.limiter.admit(key, parsed, policy, record.request_id)
            except GatewayError as err:
                if isinstance(err, KeyRefusal):
                    headers.update(err.headers)
                outcome.refused(err)
                return error_response(room, err, headers)
            parsed = admission.parsed
            headers.update(admission.headers)  # x-ratelimit-*: what the key has left
        try:
            if key is not None:  # again here: no await between this check and the slot taken by the service
                self._check_share(key.key_id, settings.max_concurrent, settings.key_share)
            self._check_capacity(settings.max_concurrent)
        except GatewayError as err:
            outcome.refused(err)
            return error_response(room, err, headers)
        return Admitted(parsed, key, rollout, group, token_in, bool(recording))

    def _check_share(self, key_id: str, max_concurrent: int, share: float) -> None:
        """A managed key may hold ``share`` of this process's generation slots (at least one):
        past it, 429 ``concurrency_limited`` while other keys are still served."""
        capacity = self.parts.capacity
        limit = max_concurrent if capacity is None else capacity.limit(max_concurrent)
        cap = key_share_cap(limit, share)
        if self.parts.running.of_key(key_id) >= cap:
            raise GatewayError("rate_limit", "concurrency_limited",
                               f"this API key holds its share of the gateway: {cap} of its {limit} concurrent requests"
                               " (--key-share)", retry_after=1)

    def _check_capacity(self, max_concurrent: int) -> None:
        """A free generation slot (this replica's share of ``max_concurrent``), else the 503."""
        capacity = self.parts.capacity
        limit = max_concurrent if capacity is None else capacity.limit(max_concurrent)
        if len(self.parts.running) >= limit:
            raise GatewayError(
                "overloaded", ErrorCode.CAPACITY_EXCEEDED,
                f"the gateway is at its limit of {limit} concurrent requests", retry_after=1,
            )

    def _hold_body(self, size: int, limit: int) -> int:
        """Reserve ``size`` body bytes (returned), or the 503 that says the budget is spent."""
        bodies = self.parts.bodies
        bodies.limit = limit
        if not bodies.reserve(size):
            raise GatewayError(
                "overloaded", "too_many_request_bytes",
                f"the gateway holds {limit} bytes of request bodies already (--max-body-bytes-in-flight)",
                retry_after=1,
            )
        return size


async def _rollout_token_in(
    rollouts: RolloutRecorder, rollout: str, parsed: ParsedRequest, upstream: UpstreamClient, owner: str
) -> TokenIn | None:
    """A recorded rollout's call: refused when the rollout is another client key's (or was
    deleted lately), and while it is frozen; with token-in configured, the plan to continue
    the rollout's tokens (else None)."""
    await rollouts.owners.claim(rollout, owner)
    await rollouts.refuse_frozen(rollout)
    if not rollouts.token_in_configured:
        return None
    history = await rollouts.history(rollout)
    # compares the whole history with the body: grows with the rollout, off the loop
    plan = await asyncio.to_thread(continuation, history, parsed.upstream_body)
    return TokenIn(plan, parsed.upstream_body, upstream)


#: A refused request's body up to this size is read (not parsed) before the answer.
SKIPPED_BODY = 64 * 1024


async def skip_small_body(request: HTTPConnection) -> None:
    """Read (and drop) the small body of a request refused before its body was read, so its
    connection stays open for the next request: unread, the server closes it, and a client
    that floods reconnects each time, which costs the gateway more than the refusal itself.
    Larger bodies, or one that does not arrive at once, are left (the connection closes)."""
    if not isinstance(request, Request) or not 0 < _declared_length(request) <= SKIPPED_BODY:
        return
    with contextlib.suppress(Exception):
        async with asyncio.timeout(0.05):
            await request.body()


def name_key(record: RequestRecord, request: HTTPConnection) -> None:
    """The managed key a request presented (also a revoked one), on its record."""
    key = named_key(request)
    if key is not None:
        record.key_id, record.key_name = key.key_id, key.name


def _declared_length(request: HTTPConnection) -> int:
    """The body's ``Content-Length`` (0 when absent or not a number; BodyLimit refuses the
    body past --max-body-bytes however it is declared)."""
    raw = request.headers.get("content-length") or ""
    return int(raw) if raw.isdigit() and len(raw) < 19 else 0
