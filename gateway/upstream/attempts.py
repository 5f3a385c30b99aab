"""One upstream answer, with failover: pool + client + policy -> an async iterator of items.

While the upstream has not answered 200 (so nothing reached the client), a failed attempt
is reported to the pool and the next credential is tried, up to ``policy.failover_max``
more times. The pool's router picks each credential from the call's session and, when it
routes by prefix, the body's prefix chain (gateway/upstream/routing.py). Every attempt is
logged in :attr:`UpstreamAttempts.log` (credential fingerprint, upstream name, routing
reason, HTTP status, error code, duration); the request record is not touched here — the
generation copies the log when it reports the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gateway.engines.continuation import continuing
from gateway.engines.fleet import EngineFleet
from gateway.engines.versions import VersionTrail
from gateway.errors import ErrorCode, GatewayError
from gateway.generation.offload import BODIES, OffloadFull
from gateway.generation.policy import StreamPolicy
from gateway.rollout.tokens import with_token_fields
from gateway.upstream.client import ANSWERED, Send, UpstreamClient, UpstreamItem
from gateway.upstream.credential import Credential
from gateway.upstream.pool import Lease, UpstreamPool, engine_of
from gateway.upstream.routing import prefix_chain
from gateway.upstream.token_in import TokenIn

#: Bodies with more messages than this have their prefix chain hashed in a worker thread
#: (a few microseconds a message: kept off the event loop past ~1 ms).
CHAIN_ON_LOOP_MESSAGES = 256
#: Seconds the chain may take there before the call is routed without it.
CHAIN_SECONDS = 5.0


class UpstreamAttempts:
    """Streams one upstream answer for a body, failing over between credentials."""

    def __init__(
        self, pool: UpstreamPool, client: UpstreamClient, policy: StreamPolicy, session: str | None = None,
        trace_context: str | None = None, token_in: TokenIn | None = None,
        upstream_headers: dict[str, str] | None = None, engines: EngineFleet | None = None,
        request_id: str | None = None,
    ) -> None:
        self.pool = pool
        self.client = client
        self.policy = policy
        self.session = session
        #: sent with every attempt (the session id under --upstream-session-header)
        self.upstream_headers = upstream_headers
        #: the request span's W3C traceparent (tracing on): each attempt sends a child of it
        self.trace_context = trace_context
        #: every attempt of this request (over every regeneration), oldest first
        self.log: list[dict[str, Any]] = []
        self.upstream_model: str | None = None  # the model name the last attempt sent
        #: a rollout call's token-in continuation (gateway/upstream/token_in.py): its chat
        #: attempts go through it (token ids to an engine that has token_in, else chat)
        self.token_in = token_in
        #: weight sync (gateway/engines/): while the engines are paused, calls to them wait in
        #: its hold; a chat answer an engine aborts is continued
        self.engines = engines
        #: the gateway's request id: a chat attempt at an engine-API upstream is sent with
        #: ``X-Request-Id: <request_id>-<attempt number>`` (what its ``/abort_requests`` takes)
        self.request_id = request_id
        #: the attempt at an engine-API upstream running now: its credential and the
        #: ``X-Request-Id`` it was sent with (a rollout abort tells that engine; None between attempts)
        self.engine_request: tuple[Credential, str] | None = None

    async def stream(self, body: dict[str, Any], send: Send | None = None) -> AsyncIterator[UpstreamItem]:
        """Yield ANSWERED, then the chunks (and DONE) of one answer; raise GatewayError
        when every allowed attempt failed or the answer broke after it began. ``send``:
        the request of one attempt (default: a chat completion; the relayed routes pass
        the client's ``stream_path``/``json_path``)."""
        chat = send is None
        send = send or (self.token_in.send if self.token_in is not None else self.client.stream_chat)
        pool = self.pool
        model = str(body.get("model", ""))
        tried: set[str] = set()
        last_error: GatewayError | None = None
        # with one credential there is nothing to choose: no hashing (the single-upstream cost stays as it was)
        prefix = await _prefix_of(body) if pool.router.uses_prefix and len(pool.credentials) > 1 else ()
        for _ in range(1 + self.policy.failover_max):
            try:
                lease = await self._acquire(model, tried, prefix)
            except GatewayError as err:
                if err.code == ErrorCode.ENGINE_PAUSED:
                    raise
                # after a failed attempt, the client hears what the upstream said, unless
                # every credential now cools down: then when to come back
                raise (last_error if last_error is not None and err.kind != "rate_limit" else err) from None
            credential = lease.credential
            tried.add(credential.id)
            upstream_body = dict(body, model=credential.upstream.upstream_model(model))
            if credential.upstream.capture_tokens and chat:  # this upstream's own token source (chat answers only)
                upstream_body = with_token_fields(upstream_body, credential.upstream.capture_tokens)
            self.upstream_model = upstream_body["model"]
            attempt: dict[str, Any] = {
                "credential": credential.fingerprint, "upstream": credential.upstream.name,
                "routing": lease.routing, "status": None,
                "started_at": time.time(),  # wall clock, for the trace's attempt span
            }
            self.log.append(attempt)
            trail = self.engines.track(credential) if self.engines is not None and chat else None
            if trail is not None:  # the answer's weight versions per token range (gateway/engines/versions.py)
                attempt["weight_versions"] = trail.versions
            headers = dict(self.upstream_headers) if self.upstream_headers else None
            if self.trace_context:  # the attempt's span id, told to the upstream (vLLM, SGLang trace it)
                version, trace_id, _, flags = self.trace_context.split("-")
                attempt["span_id"] = secrets.token_hex(8)
                headers = {**(headers or {}), "traceparent": f"{version}-{trace_id}-{attempt['span_id']}-{flags}"}
            if chat and credential.upstream.engine_api is not None and self.request_id is not None:
                engine_request_id = attempt["engine_request_id"] = f"{self.request_id}-{len(self.log)}"
                headers = {**(headers or {}), "x-request-id": engine_request_id}
                self.engine_request = (credential, engine_request_id)
            started = time.monotonic()
            answered = False
            try:
                # closed here, at once, when this generator is (not whenever it is collected)
                attempt_send = self._chat(trail) if chat else send
                async with contextlib.aclosing(attempt_send(credential, upstream_body, self.policy, headers)) as items:  # type: ignore[type-var]
                    async for item in items:
                        if item is ANSWERED:
                            answered = True
                            attempt["status"] = 200
                        yield item
                # answered in full: the replica's pace, for the router (gateway/upstream/routing.py)
                pool.router.observe(engine_of(credential), time.monotonic() - started)
                return
            except GatewayError as err:
                attempt["status"] = err.upstream_status
                attempt["error"] = err.code
                if answered or not pool.report_failure(credential, model, err):
                    raise
                last_error = err
            finally:
                self.engine_request = None
                lease.release()
                if trail is not None:
                    self.engines.untrack(trail)  # type: ignore[union-attr]
                attempt["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
        raise self._after_failover(model, tried, last_error)

    def _chat(self, trail: VersionTrail | None) -> Send:
        """A chat attempt (through token-in for a rollout call that has it); with weight
        sync, its aborts continued (gateway/engines/continuation.py)."""
        token_in = self.token_in
        first = token_in.send if token_in is not None else self.client.stream_chat
        if self.engines is None:
            return first
        return continuing(first, self.engines.accepting, self.engines.on_continued, trail,
                          self.client.stream_path("/completions"),
                          (lambda: token_in.reader) if token_in is not None else None)

    async def _acquire(self, model: str, tried: set[str], prefix: Sequence[int] = ()) -> Lease:
        """A credential for the next attempt; while its engine is paused, the call waits in
        the hold (no lease held meanwhile), then picks again."""
        while True:
            lease = await self._slot(model, tried, prefix)
            upstream = lease.credential.upstream
            if self.engines is None or not self.engines.hold.holds(upstream.engine_api):
                return lease
            lease.release()
            await self.engines.hold.wait(upstream.name, self.policy.engine_pause_max)

    async def _slot(self, model: str, tried: set[str], prefix: Sequence[int]) -> Lease:
        """A lease; while every usable engine runs its ``max_in_flight`` requests, the call
        waits here for a release (its first-byte timer has not started: a queue in the
        engine would spend it), up to the upstream's ``queue_timeout``, then the 503."""
        deadline: float | None = None
        while True:
            try:
                return self.pool.acquire(model, tried, self.session, prefix)
            except GatewayError as err:
                bound = self.pool.waits_for_slot(model, tried)
                if bound is None:
                    raise
                now = time.monotonic()
                deadline = now + bound if deadline is None else deadline
                if now >= deadline:
                    raise GatewayError("overloaded", "upstream_capacity", f"every upstream engine ran its max_in_flight"
                                       f" requests for {bound:g} s (queue_timeout)", retry_after=1) from err
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(deadline - now):
                        await self.pool.slots.freed().wait()

    def _after_failover(self, model: str, tried: set[str], last_error: GatewayError | None) -> GatewayError:
        """Failover is used up: when every credential now cools down, say when to retry."""
        assert last_error is not None
        try:
            self.pool.acquire(model, tried).release()
        except GatewayError as err:
            if err.kind == "rate_limit":
                return err
        return last_error


async def _prefix_of(body: dict[str, Any]) -> tuple[int, ...]:
    """The body's prefix chain for the router: on the loop for a usual body, in a worker
    thread for a long one; none (routed by load alone) when the workers are busy."""
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) <= CHAIN_ON_LOOP_MESSAGES:
        return prefix_chain(body)
    try:
        return await BODIES.run(prefix_chain, body, timeout=CHAIN_SECONDS)
    except (OffloadFull, TimeoutError):
        return ()
