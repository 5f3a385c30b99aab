"""Parsing, translating and counting request bodies without stalling the event loop.

A 28 MiB body of a million tiny messages costs seconds of CPU to parse and validate,
and orjson and pydantic hold the GIL while they run, so a worker *thread* would stall
the loop as much. Three ways, chosen by what a body can cost:

- small (under :data:`SMALL_BODY`): parsed on the loop, as before (no thread hop: the
  common request stays as cheap as it was);
- larger but sparse (at most :data:`DENSE_VALUES` ``{``/``[`` bytes, an upper bound of
  its objects and lists: big prompts): in a worker thread (``offload.BODIES``); a long
  string costs orjson a copy, not a walk;
- dense (for ``/v1/completions`` and ``/v1/embeddings`` also: more than
  :data:`DENSE_VALUES` commas, token-id prompts): in a worker *process* (:class:`ProcessParser`, forkserver), which parses,
  checks the item limits and translates, and hands back the parsed request (bounded by
  those limits) or the error. Its GIL is its own.

Each way raises the room's :class:`GatewayError` for bad input, as ``room.parse`` does.
:class:`BodyBudget` bounds the bytes of bodies held by requests at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from gateway.errors import GatewayError
from gateway.generation.offload import BODIES, OffloadFull
from gateway.protocols.base import ParsedRequest, ProtocolRoom
from gateway.protocols.envelope import ANONYMOUS_TENANT, FixedKeys, Tenant

T = TypeVar("T")

#: Bodies up to this size are parsed on the event loop (~1 ms at most).
SMALL_BODY = 64 * 1024
#: ``{`` + ``[`` bytes past which a body goes to a worker process.
DENSE_VALUES = 20_000
#: Seconds a parse may take in a worker before the request is answered 503.
PARSE_SECONDS = 60.0


def overloaded(what: str) -> GatewayError:
    return GatewayError("overloaded", "parser_busy", f"the gateway is busy {what}; retry shortly", retry_after=1)


def _room_kind(room: ProtocolRoom) -> str | None:
    """Which parser a worker process builds for ``room`` (None: only this process can)."""
    from gateway.generation.passthrough import CompletionsRoute, EmbeddingsRoute
    from gateway.protocols.chat import ChatRoom
    from gateway.protocols.messages.room import MessagesRoom
    from gateway.protocols.responses.room import ResponsesCompactRoom, ResponsesRoom

    for kind, cls in (("compact", ResponsesCompactRoom), ("responses", ResponsesRoom),
                      ("chat", ChatRoom), ("messages", MessagesRoom),
                      ("completions", CompletionsRoute), ("embeddings", EmbeddingsRoute)):
        if isinstance(room, cls):
            return kind
    return None


def _child_room(kind: str) -> Any:
    from gateway.generation.passthrough import CompletionsRoute, EmbeddingsRoute
    from gateway.protocols.chat import ChatRoom
    from gateway.protocols.messages.room import MessagesRoom
    from gateway.protocols.responses.room import ResponsesCompactRoom, ResponsesRoom

    if kind == "chat":
        return ChatRoom()
    if kind == "messages":
        return MessagesRoom()
    if kind in ("completions", "embeddings"):
        return CompletionsRoute() if kind == "completions" else EmbeddingsRoute()
    return (ResponsesCompactRoom if kind == "compact" else ResponsesRoom)(None)  # parse needs no store


def _error_fields(err: GatewayError) -> tuple[Any, ...]:
    return (err.kind, err.code, err.message, err.param, err.status, err.retry_after)


def _child_parse(kind: str, body: bytes, query: dict[str, str], tenant: Tenant) -> tuple[str, Any]:
    """In the worker process: ("ok", ParsedRequest) or ("error", the error's fields)."""
    try:
        return "ok", _child_room(kind).parse(body, query, tenant)
    except GatewayError as err:
        return "error", _error_fields(err)


def _count(body: bytes | str) -> tuple[str, int]:
    """The model and input tokens of a count_tokens body (its translation, then the o200k count)."""
    from gateway.protocols.messages.translate import translate
    from gateway.protocols.tokens import count_chat_tokens

    translation = translate(body, count_only=True)  # type: ignore[arg-type]
    return translation.model, count_chat_tokens(translation.body)


def _raise(fields: tuple[Any, ...]) -> GatewayError:
    kind, code, message, param, status, retry_after = fields
    return GatewayError(kind, code, message, param=param, status=status, retry_after=retry_after)


#: Seconds between a parse worker's checks that its gateway process is still there.
PARENT_CHECK_SECONDS = 1.0


def exit_with(gateway_pid: int) -> None:
    """A parse worker's initializer: exit when the gateway process is gone.

    A worker never sees its gateway die on its own: it holds the write ends of its own call
    queue and of the forkserver's liveness pipe, so after a SIGKILL (an OOM kill, a crashed
    ``--workers`` worker) the worker and the forkserver lived on, idle, ~60-90 MiB each, one
    pair per dead gateway process."""

    def watch() -> None:
        while _alive(gateway_pid):
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-gateway", daemon=True).start()


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


class ProcessParser:
    """A small pool of worker processes (forkserver: never a fork of the running gateway),
    started on first use; each worker is replaced after a number of bodies so the memory a
    huge parse left behind goes back to the system."""

    def __init__(self, workers: int = 1, max_pending: int = 8, tasks_per_child: int = 8) -> None:
        self.workers = workers
        self.max_pending = max_pending
        self.tasks_per_child = tasks_per_child
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.pending = 0

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(["gateway.generation.body_parsing", "gateway.protocols.responses.room"])
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=context, max_tasks_per_child=self.tasks_per_child,
                    initializer=exit_with, initargs=(os.getpid(),),
                )
            return self._pool

    async def run(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            if self.pending >= self.max_pending:
                raise overloaded("parsing other large requests")
            self.pending += 1
        try:
            # submitted from a thread: the first submit starts the forkserver and a worker,
            # which waits for their imports (~0.5 s), and the body is written to a pipe
            async with asyncio.timeout(PARSE_SECONDS):  # not wait_for: on 3.11 it can swallow a cancel
                submitted = await asyncio.to_thread(self._submit, fn, *args)
            async with asyncio.timeout(PARSE_SECONDS):
                status, value = await asyncio.wrap_future(submitted)
        except (TimeoutError, BrokenProcessPool):
            self._reset()
            raise overloaded("parsing other large requests") from None
        finally:
            with self._lock:
                self.pending -= 1
        if status == "error":
            raise _raise(value)
        return value

    def _submit(self, fn: Any, *args: Any) -> Any:
        return self._executor().submit(fn, *args)

    def _reset(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._reset()


PROCESSES = ProcessParser()


def is_dense(body: bytes | str, numbers: bool = False) -> bool:
    """More ``{``/``[`` bytes than :data:`DENSE_VALUES` (C-speed counts over the first
    bytes that can decide it: a few ms at most); ``numbers``: ``,`` bytes count too (a
    list of token ids is one ``[`` and a million numbers, each a walk for the parser)."""
    brace, bracket, comma = (b"{", b"[", b",") if isinstance(body, bytes) else ("{", "[", ",")
    seen = 0
    for start in range(0, len(body), _SCAN):
        piece = body[start:start + _SCAN]
        seen += piece.count(brace) + piece.count(bracket)  # type: ignore[arg-type]
        if numbers:
            seen += piece.count(comma)  # type: ignore[arg-type]
        if seen > DENSE_VALUES:
            return True
    return False


_SCAN = 1024 * 1024


async def parse_request(
    room: ProtocolRoom, body: bytes, query: dict[str, str], tenant: Tenant = ANONYMOUS_TENANT
) -> ParsedRequest:
    """``room.parse(body, query, tenant)``, where it does not stall the loop (see the module).
    A worker process gets the tenant's keyring as it is now and the request comes back
    with the live tenant on it."""
    if len(body) <= SMALL_BODY:
        return room.parse(body, query, tenant)
    kind = _room_kind(room)
    if kind is not None and is_dense(body, numbers=kind in ("completions", "embeddings")):
        snapshot = Tenant(tenant.identity, FixedKeys(tenant.keys()))
        parsed = await PROCESSES.run(_child_parse, kind, body, query, snapshot)
        return dataclasses.replace(parsed, tenant=tenant)
    try:
        return await BODIES.run(room.parse, body, query, tenant, timeout=PARSE_SECONDS)
    except (OffloadFull, TimeoutError):
        raise overloaded("parsing other large requests") from None


def _child_call(fn: Callable[[Any], Any], body: bytes | str) -> tuple[str, Any]:
    """In the worker process: ("ok", ``fn(body)``) or ("error", the error's fields)."""
    try:
        return "ok", fn(body)
    except GatewayError as err:
        return "error", _error_fields(err)


async def off_loop(fn: Callable[[bytes | str], T], body: bytes | str, what: str) -> T:
    """``fn(body)``, a pure reading of client-sent JSON (a module-level function: a worker
    process may run it), where it does not stall the loop: inline when small, in a worker
    process when dense, else in a thread. What it returns should be small (bytes, not a
    parsed tree): bringing a big tree back from a process costs the loop its unpickling."""
    if len(body) <= SMALL_BODY:
        return fn(body)
    if is_dense(body):
        return await PROCESSES.run(_child_call, fn, body)  # type: ignore[no-any-return]
    try:
        return await BODIES.run(fn, body, timeout=PARSE_SECONDS)  # type: ignore[no-any-return]
    except (OffloadFull, TimeoutError):
        raise overloaded(what) from None


async def count_tokens(body: bytes) -> tuple[str, int]:
    """``count_tokens``' model, translation and o200k count, off the loop past :data:`SMALL_BODY`
    (the tokenizer's tables loaded in a thread first: seconds the first time)."""
    from gateway.protocols.tokens import tokenizer_ready

    await tokenizer_ready()
    return await off_loop(_count, body, "counting other large requests")


class BodyBudget:
    """The bytes of request bodies held by requests at once (``--max-body-bytes-in-flight``,
    0 = unbounded); a request past it is refused 503 with Retry-After before its body is
    read. Thread-safe (WebSocket frames and HTTP requests share it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def reserve(self, size: int) -> bool:
        with self._lock:
            if self.limit and self.held and self.held + size > self.limit:
                return False  # one body alone may always use the whole budget
            self.held += size
            return True

    def release(self, size: int) -> None:
        with self._lock:
            self.held = max(0, self.held - size)
