"""Reservations: before a request of a key with limits goes upstream it reserves its input
tokens plus its output cap in the store (one atomic transaction, in a worker thread,
within :data:`RESERVE_TIMEOUT`); the reservation is settled to the real usage when the
request ends. A request that cannot reserve is refused, and so is one whose reservation
the store cannot answer in time (fail closed): the limits hold under any concurrency, on
any number of replicas.

The input reservation is an upper bound for text, not an estimate: the UTF-8 bytes of the
messages and tools sent upstream (a token is at least one byte; the JSON punctuation pays
for the per-message tokens); each media part is reserved at a per-item estimate instead
(gateway/keys/media.py: an image costs its pixels, not its bytes). The output cap is the smallest length the request names in any
engine's field (gateway/keys/output_cap.py), or, when it names none, the key's
``max_output_tokens`` (default :data:`~gateway.keys.model.DEFAULT_OUTPUT_CAP`) lowered to
what the key has left (gateway/keys/quota.py); the granted cap is then sent upstream in
every length field the body speaks, so the answer cannot outgrow what was reserved. With
tool repair in compatible mode every regeneration may spend it again, and a text
completion's ``n`` / ``best_of`` answers each, so it counts that many times.

Settlement never leaks a reservation nor loses usage: it goes through the app's
:class:`~gateway.store.spill.DurableWriter` like an audit row (the store, else the fsync'd
spill journal, replayed when the store is back; both idempotent per request id). While
the request runs, its reservation's lease is renewed every
:data:`~gateway.keys.store.RENEW_EVERY` seconds; one whose settlement is still in the
journal (or whose process died) is reclaimed by the key's next reservation once its lease
(:data:`~gateway.keys.store.LEASE`) has run out.

A key with a money budget (``budget_cost``) prices the reservation at the model's ``price``
from ``--config`` and settles it to the request's cost. A model without a price is refused
(403 ``model_not_priced``) for such a key: counting it as free would let it spend without
limit under a cap meant to stop spending.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from gateway.errors import GatewayError
from gateway.generation.policy import StreamPolicy
from gateway.generation.record import RequestRecord
from gateway.keys import store
from gateway.keys.full_windows import FullWindows
from gateway.keys.media import media_adjustment
from gateway.keys.model import DEFAULT_OUTPUT_CAP, ManagedKey
from gateway.keys.output_cap import answers_of, capped, requested_cap
from gateway.keys.quota import NANOS, Ask, Grant, Rates, Refusal
from gateway.observability.pricing import cost as priced
from gateway.protocols.base import ParsedRequest
from gateway.store.db import Store
from gateway.store.refresher import Refresher
from gateway.store.spill import DurableWriter
from gateway.upstream.config_file import ModelPrice

#: The price of a model (its ``[models."<glob>"]`` table's ``price``), or None.
PriceOf = Callable[[str], "ModelPrice | None"]

#: Seconds a refusal answered from memory (a full ``rpm`` window) waits first, at most.
REFUSAL_PACE = 1.0

log = structlog.get_logger("gateway.keys")

#: Seconds a reservation may take before the request is refused (fail closed).
RESERVE_TIMEOUT = 2.0
#: Seconds a settlement may take to be stored or journaled (past it: logged as lost; the
#: lease still frees the reservation).
SETTLE_TIMEOUT = 10.0
#: Seconds one lease renewal may take.
RENEW_TIMEOUT = 5.0
#: Seconds a key's next reservation waits, at most, for the key's settlements under way.
SETTLED_WAIT = 2.0


def input_bound(body: dict[str, Any]) -> int:
    """The input tokens an upstream body reserves (see the module docstring): a chat body's
    messages and tools, with each media part at its estimate (gateway/keys/media.py), else
    (``/v1/completions``, ``/v1/embeddings``) the whole body."""
    if "messages" not in body:
        return len(orjson.dumps(body))
    messages = body.get("messages") or []
    return len(orjson.dumps(messages)) + len(orjson.dumps(body.get("tools") or [])) + media_adjustment(messages)


def key_share_cap(total: int, share: float) -> int:
    """What one managed key may hold of ``total`` slots or connections (``--key-share``)."""
    return max(1, int(total * share))


def repair_answers(parsed: ParsedRequest, policy: StreamPolicy) -> int:
    """Answers one request may generate: tool repair in compatible mode may regenerate."""
    if parsed.upstream_body.get("tools") and policy.mode.value == "compatible":
        return 1 + policy.tool_repair_attempts
    return 1


def rates_of(price: ModelPrice) -> Rates:
    """A reservation's rates: cached input is not known before the answer, so all input is
    held at the dearer of ``input`` and ``cached_input``."""
    return Rates.of(max(price.input, price.cached_input or 0.0), price.output)


def ask_of(key: ManagedKey, parsed: ParsedRequest, policy: StreamPolicy, price: ModelPrice | None = None) -> Ask:
    """What a request asks to hold: nothing for a key without token limits; else its input
    bound, and its own output cap (the smallest length it names in any engine's field) or,
    when it names none, the key's ``max_output_tokens``, which the gateway may lower to
    what remains; priced at ``price`` for a key with a money budget."""
    if not key.limits.token_limited:
        return Ask()
    rates = rates_of(price) if price is not None and key.limits.budget_cost is not None else None
    body = parsed.upstream_body
    if parsed.protocol == "embeddings":
        return Ask(input_bound(body), rates=rates)
    requested = requested_cap(body)
    cap = requested if requested is not None else key.limits.max_output_tokens or DEFAULT_OUTPUT_CAP
    answers = repair_answers(parsed, policy) * answers_of(body, parsed.protocol)
    return Ask(input_bound(body), cap, answers, flexible=requested is None, rates=rates)


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request: the body as it goes upstream and the key's ``x-ratelimit-*``."""

    parsed: ParsedRequest
    headers: dict[str, str]


class KeyRefusal(GatewayError):
    """A refusal of the key's limits, with the ``x-ratelimit-*`` headers of the key then
    (and ``x-should-retry: false``, which the OpenAI and Anthropic SDKs obey, when
    waiting cannot help)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__("rate_limit", refusal.code, refusal.message, retry_after=refusal.retry_after)
        self.headers = refusal.quota.headers() if refusal.quota is not None else {}
        if refusal.retry_after is None:
            self.headers["x-should-retry"] = "false"


@dataclass(frozen=True, slots=True)
class Arrived:
    """What the upstream produced for a request that ended without its usage (the client
    cancelled, the stream was cut, the answer failed): the last running usage it reported,
    else its prompt (the body sent) and the pieces of answer that arrived, counted with
    o200k_base in the settlement's worker thread (not on the loop)."""

    reported: int = 0  # a running total the upstream sent before the end (vLLM continuous usage)
    body: dict[str, Any] | None = None  # None: the upstream never answered
    pieces: tuple[list[str], ...] = ()  # text, reasoning, tool-argument parts (not joined yet)

    def tokens(self) -> int:
        """Blocking (tokenizer): the tokens to charge."""
        if self.reported > 0:
            return self.reported
        if self.body is None:
            return 0
        from gateway.protocols.tokens import count_chat_tokens, count_text

        return count_chat_tokens(self.body) + sum(count_text("".join(parts)) for parts in self.pieces)


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
                 renew_every: float = store.RENEW_EVERY, price: PriceOf = lambda model: None) -> None:
        self.db = db
        self.price = price
        #: told a key's id once a settlement of it is recorded (the budget-left gauge)
        self.on_settled: Callable[[str], None] | None = None
        self.durable = durable
        self.reserve_timeout = reserve_timeout
        self._open: set[str] = set()
        self.full_windows = FullWindows()  # keys past their rpm: refused without the store
        self._tasks: set[asyncio.Task[Any]] = set()
        self._settling: dict[str, set[asyncio.Task[Any]]] = {}  # key id -> its settlements under way
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

    async def admit(self, key: ManagedKey, parsed: ParsedRequest, policy: StreamPolicy, request_id: str) -> Admission:
        """The model check, then the reservation (for a key with counted limits); returns
        the request as it goes upstream (with the granted output cap), or raises the refusal."""
        key.check_model(parsed.model)
        if not key.limits.counted:
            return Admission(parsed, {})
        price = self.price(parsed.model) if key.limits.budget_cost is not None else None
        if key.limits.budget_cost is not None and price is None:
            raise GatewayError("permission", "model_not_priced",
                               f"this API key has a budget in money (budget_cost) and the model {parsed.model!r} has no "
                               "price in the gateway's --config", param="model")
        await self._settled(key)
        grant = await self._decide(key, request_id,
                                   lambda: store.admit(self.db, key, request_id, ask_of(key, parsed, policy, price)))
        self._open.add(request_id)
        if key.limits.token_limited and parsed.protocol != "embeddings":
            parsed = dataclasses.replace(parsed, upstream_body=capped(parsed.upstream_body, grant.cap),
                                         output_cap=grant.cap)
        return Admission(parsed, grant.quota.headers())

    async def admit_side(self, key: ManagedKey, model: str | None, request_id: str) -> dict[str, str]:
        """A request that generates nothing (``count_tokens``, a Responses WebSocket
        ``generate: false`` frame): the model check (when the model is known), and, for a
        key with ``rpm``, one request in its window (no tokens, recorded as ended).
        Returns the ``x-ratelimit-*`` headers, or raises the refusal."""
        if model is not None:
            key.check_model(model)
        if key.limits.rpm is None:
            return {}
        await self.refuse_full(key)
        grant = await self._decide(key, request_id, lambda: store.admit(self.db, key, request_id, Ask(generates=False)))
        return grant.quota.headers()

    async def refuse_full(self, key: ManagedKey) -> None:
        """From memory, before anything is read: raises the refusal of a key whose ``rpm``
        window the store found full and still is (gateway/keys/full_windows.py). The refusal
        is paced: a key that asks again before its window frees waits up to
        :data:`REFUSAL_PACE` for it (no slot, no store, nothing read meanwhile), so one
        connection cannot repeat refusals faster than that. Answered at once, a flood of 64
        kept-alive connections made 2,600 refusals a second, a whole core of the loop, and
        another key's p99 went 4.6x (bench/key_flood.py on an idle machine). A window that
        frees during the wait lets the request go on."""
        now = time.time()
        refusal = self.full_windows.refusal(key, now)
        if refusal is None:
            return
        wait = self.full_windows.frees_in(key, now)
        await asyncio.sleep(min(REFUSAL_PACE, wait))
        refusal = self.full_windows.refusal(key, time.time())
        if refusal is not None:
            raise KeyRefusal(refusal)

    async def _decide(self, key: ManagedKey, request_id: str, reserve: Any) -> Grant:
        """``reserve()`` on the store's threads (sizing serialises the body: megabytes, past a
        millisecond, not on the loop; then the store's transaction), within its bound."""
        job = asyncio.ensure_future(self.db.acall(reserve))  # the store's own threads
        done, _ = await asyncio.wait({job}, timeout=self.reserve_timeout)
        if not done:  # it may still commit: give it back then
            job.add_done_callback(lambda f: self._late(f, request_id))
            raise _unavailable("the key store did not answer in time")
        try:
            decision = job.result()
        except Exception as exc:
            log.warning("client_key_reserve_failed", error=f"{type(exc).__name__}: {exc}")
            raise _unavailable("the key store cannot answer now") from None
        if isinstance(decision, Refusal):
            self.full_windows.note(key, decision)
            raise KeyRefusal(decision)
        return decision  # type: ignore[no-any-return]

    def _late(self, job: asyncio.Future[Any], request_id: str) -> None:
        if not job.cancelled() and job.exception() is None and isinstance(job.result(), Grant):
            self._spawn(self._record(store.SETTLE_KIND, (request_id, 0, 0)))

    def finished(self, key: ManagedKey | None, record: RequestRecord, arrived: Arrived | None = None) -> None:
        """At the request's one report: settle its reservation to what it used (or count
        the usage of a key without counted limits; ``key`` None: deleted meanwhile); a
        request that ended without usage is charged what ``arrived``. Never waits: a task
        does it."""
        used = used_tokens(record)
        charge = arrived if used == 0 and arrived is not None else None
        money = key is not None and key.limits.budget_cost is not None and record.model
        price = self.price(record.model) if money else None  # only a money budget needs the cost
        if record.request_id in self._open:
            self._open.discard(record.request_id)
            task = self._spawn(self._settle(store.SETTLE_KIND, (record.request_id,), used, charge, record, price))
            if key is not None:
                self._settling.setdefault(key.key_id, set()).add(task)
                task.add_done_callback(lambda t, key_id=key.key_id: self._forget_settling(key_id, t))
        elif key is not None and not key.limits.counted and record.outcome not in ("refused", "invalid"):
            self._spawn(self._settle(store.COUNT_KIND, (record.request_id, key.key_id), used, charge, record, price))

    async def _settled(self, key: ManagedKey) -> None:
        """The key's settlements under way, done (at most :data:`SETTLED_WAIT`): a client
        that sends its next request as soon as the last answer ends must find that answer
        settled to its usage, not still holding its reservation (input bound + max_tokens),
        else it is refused for tokens it never used (seen at load 20: a settlement's store
        write lagged the next request). Past the bound the reservation decides on what is
        stored, as before."""
        pending = self._settling.get(key.key_id)
        if pending:
            await asyncio.wait(set(pending), timeout=SETTLED_WAIT)

    def _forget_settling(self, key_id: str, task: asyncio.Task[Any]) -> None:
        pending = self._settling.get(key_id)
        if pending is not None:
            pending.discard(task)
            if not pending:
                del self._settling[key_id]

    async def _settle(self, kind: str, head: tuple[Any, ...], used: int, charge: Arrived | None,
                      record: RequestRecord, price: ModelPrice | None) -> None:
        """The usage (counted from what arrived, in a worker thread, when the upstream sent
        none) and its cost, then its settlement recorded durably."""
        if charge is not None:
            try:
                async with asyncio.timeout(SETTLE_TIMEOUT):
                    used = await asyncio.to_thread(charge.tokens)
            except Exception as exc:  # the reservation is settled to what the usage said
                log.warning("client_key_charge_failed", request_id=head[0], error=f"{type(exc).__name__}: {exc}")
        await self._record(kind, (*head, used, cost_nanos(record, price, used if charge is not None else None)))
        if self.on_settled is not None and record.key_id:
            self.on_settled(record.key_id)

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

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        """At shutdown: stop renewing, let the settlements under way finish (each is
        bounded: stored or journaled)."""
        await self.leases.aclose()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._lease_thread.shutdown(wait=False)


def cost_nanos(record: RequestRecord, price: ModelPrice | None, charged: int | None) -> int | None:
    """What a request cost, in nano-units: its usage priced (as its audit record's ``cost``);
    tokens counted from what arrived (``charged``) at the dearest rate (they mix prompt and
    answer); 0 for nothing used; None without a price (the reservation's hold then stays)."""
    if price is None:
        return None
    if charged is not None:
        return charged * max(rates_of(price).input, rates_of(price).output)
    spent = priced(record.usage, price) if record.usage else None
    return 0 if spent is None else round(spent * NANOS)


def _unavailable(message: str) -> GatewayError:
    return GatewayError("overloaded", "key_store_unavailable", message + "; requests of keys with limits are refused",
                        retry_after=1)
