"""Reservations: before a request of a key with limits goes upstream it reserves its input
tokens plus its output cap in the store (one atomic transaction, in a worker thread,
within :data:`RESERVE_TIMEOUT`); the reservation is settled to the real usage when the
request ends. A request that cannot reserve is refused, and so is one whose reservation
the store cannot answer in time (fail closed): the limits hold under any concurrency, on
any number of replicas.

The input reservation is an upper bound, not an estimate: the UTF-8 bytes of the messages
and tools sent upstream (a token is at least one byte; the JSON punctuation pays for the
per-message tokens). The output cap is the request's ``max_tokens``, or the key's
``max_output_tokens`` (default :data:`~gateway.keys.model.DEFAULT_OUTPUT_CAP`), which is
then sent upstream as ``max_tokens`` so the answer cannot outgrow what was reserved; with
tool repair in compatible mode every regeneration may spend it again, so it counts that
many times.

Settlement never leaks a reservation nor loses usage: it goes through the app's
:class:`~gateway.store.spill.DurableWriter` like an audit row (the store, else the fsync'd
spill journal, replayed when the store is back; both idempotent per request id). While
the request runs, its reservation's lease is renewed every
:data:`~gateway.keys.store.RENEW_EVERY` seconds; one whose settlement is still in the
journal (or whose process died) is reclaimed by the key's next reservation once its lease
(:data:`~gateway.keys.store.LEASE`) has run out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import structlog

from gateway.errors import GatewayError
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestRecord
from gateway.keys import store
from gateway.keys.model import DEFAULT_OUTPUT_CAP, ManagedKey
from gateway.protocols.base import ParsedRequest
from gateway.store.db import Store
from gateway.store.refresher import Refresher
from gateway.store.spill import DurableWriter

log = structlog.get_logger("gateway.keys")

#: Seconds a reservation may take before the request is refused (fail closed).
RESERVE_TIMEOUT = 2.0
#: Seconds a settlement may take to be stored or journaled (past it: logged as lost; the
#: lease still frees the reservation).
SETTLE_TIMEOUT = 10.0
#: Seconds one lease renewal may take.
RENEW_TIMEOUT = 5.0


def input_bound(body: dict[str, Any]) -> int:
    """At least the input tokens of an upstream body (see the module docstring): a chat
    body's messages and tools, else (``/v1/completions``, ``/v1/embeddings``) the whole body."""
    if "messages" not in body:
        return len(orjson.dumps(body))
    return len(orjson.dumps(body.get("messages") or [])) + len(orjson.dumps(body.get("tools") or []))


def output_cap(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def with_output_cap(parsed: ParsedRequest, key: ManagedKey) -> tuple[ParsedRequest, int]:
    """The request with an upstream ``max_tokens`` (the key's cap when it named none), and
    the output tokens it may spend (none for embeddings)."""
    if parsed.protocol == "embeddings":
        return parsed, 0
    cap = output_cap(parsed.upstream_body)
    if cap is not None:
        return parsed, cap
    cap = key.limits.max_output_tokens or DEFAULT_OUTPUT_CAP
    return dataclasses.replace(parsed, upstream_body={**parsed.upstream_body, "max_tokens": cap}), cap


def reservation_size(parsed: ParsedRequest, cap: int, policy: StreamPolicy) -> int:
    body = parsed.upstream_body
    answers = 1 + (policy.tool_repair_attempts if body.get("tools") and policy.mode.value == "compatible" else 0)
    return input_bound(body) + cap * answers


def used_tokens(record: RequestRecord) -> int:
    usage = record.usage or {}
    total = usage.get("total_tokens")
    if isinstance(total, int) and total > 0:
        return total
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)


class KeyLimiter:
    """Reserves and settles for one store; remembers the open reservations of this process
    and renews their leases (:meth:`start`)."""

    def __init__(self, db: Store, durable: DurableWriter, reserve_timeout: float = RESERVE_TIMEOUT,
                 renew_every: float = store.RENEW_EVERY) -> None:
        self.db = db
        self.durable = durable
        self.reserve_timeout = reserve_timeout
        self._open: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: settlements neither stored nor journaled (their reservations wait for the lease)
        self.unsettled = 0
        self.leases = Refresher("client-key-leases", self._renew, renew_every, RENEW_TIMEOUT)
        # its own thread: a renewal stuck on the store holds none of the shared executor's
        self._lease_thread = ThreadPoolExecutor(1, thread_name_prefix="key-leases")

    async def start(self) -> None:
        await self.leases.start()

    async def _renew(self) -> None:
        if self._open:
            held = list(self._open)
            call = functools.partial(store.renew, self.db, held)
            await asyncio.get_running_loop().run_in_executor(self._lease_thread, call)

    async def admit(self, key: ManagedKey, parsed: ParsedRequest, policy: StreamPolicy, request_id: str) -> ParsedRequest:
        """The model check, then the reservation (for a key with counted limits); returns
        the request as it goes upstream (with its output cap), or raises the refusal."""
        key.check_model(parsed.model)
        if not key.limits.counted:
            return parsed
        if key.limits.token_limited:
            parsed, cap = with_output_cap(parsed, key)
        else:
            cap = output_cap(parsed.upstream_body) or 0
        sized = parsed if key.limits.token_limited else None
        job = asyncio.ensure_future(self.db.acall(self._reserve, key, request_id, sized, cap, policy))
        done, _ = await asyncio.wait({job}, timeout=self.reserve_timeout)
        if not done:  # it may still commit: give it back then
            job.add_done_callback(lambda f: self._late(f, request_id))
            raise _unavailable("the key store did not answer in time")
        try:
            refusal = job.result()
        except Exception as exc:
            log.warning("client_key_reserve_failed", error=f"{type(exc).__name__}: {exc}")
            raise _unavailable("the key store cannot answer now") from None
        if refusal is not None:
            raise GatewayError("rate_limit", refusal.code, refusal.message, retry_after=refusal.retry_after)
        self._open.add(request_id)
        return parsed

    def _reserve(self, key: ManagedKey, request_id: str, sized: ParsedRequest | None, cap: int,
                 policy: StreamPolicy) -> store.Refusal | None:
        """In the worker thread: sizing serialises the body (megabytes, past a millisecond:
        not on the loop), then the store's transaction."""
        tokens = reservation_size(sized, cap, policy) if sized is not None else 0
        return store.reserve(self.db, key, request_id, tokens)

    def _late(self, job: asyncio.Future[Any], request_id: str) -> None:
        if not job.cancelled() and job.exception() is None and job.result() is None:
            self._spawn(self._record(store.SETTLE_KIND, (request_id, 0)))

    def finished(self, key: ManagedKey | None, record: RequestRecord) -> None:
        """At the request's one report: settle its reservation to what it used (or count
        the usage of a key without counted limits; ``key`` None: deleted meanwhile). Never
        waits: a task does it."""
        used = used_tokens(record)
        if record.request_id in self._open:
            self._open.discard(record.request_id)
            self._spawn(self._record(store.SETTLE_KIND, (record.request_id, used)))
        elif key is not None and not key.limits.counted and record.outcome not in ("refused", "invalid"):
            self._spawn(self._record(store.COUNT_KIND, (record.request_id, key.key_id, used)))

    async def _record(self, kind: str, row: tuple[Any, ...]) -> None:
        """Store the settlement, else journal it (replayed when the store is back)."""
        try:
            async with asyncio.timeout(SETTLE_TIMEOUT):
                result = await self.durable.write(kind, [row])
        except TimeoutError:
            result = "timeout"
        if result not in ("stored", "spilled"):  # the lease still frees a reservation
            self.unsettled += 1
            log.error("client_key_settlement_lost", kind=kind, request_id=row[0], result=result)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """At shutdown: stop renewing, let the settlements under way finish (each is
        bounded: stored or journaled)."""
        await self.leases.aclose()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._lease_thread.shutdown(wait=False)


def _unavailable(message: str) -> GatewayError:
    return GatewayError("overloaded", "key_store_unavailable", message + "; requests of keys with limits are refused",
                        retry_after=1)
