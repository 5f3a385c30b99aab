"""``EngineFleet``: the engines configured with an engine API (``engine_api = "vllm"``),
paused and resumed together around a weight update, with the gateway's hold around them.

Pause: the hold closes first (no new call reaches an engine from here on), then every
engine gets ``/pause?mode=`` and is polled until it reports ``is_paused``. Resume: each
engine gets the new weight version (when given) and ``/resume``, then the hold opens and
the held calls go on. The fleet is read from the pool each time, so credentials added
through the admin API count too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.engines.control import Engine, EngineControl, EngineControlError, engine_root
from gateway.engines.hold import EngineHold, engine_paused
from gateway.engines.versions import VersionTrail
from gateway.generation.policy import StreamPolicy
from gateway.tasks import stop_tasks
from gateway.upstream.credential import Credential
from gateway.upstream.pool import UpstreamPool

PAUSE_MODES = ("keep", "abort", "wait")
#: Seconds one engine's status (``is_paused``, ``weight_info``) may take for the listing.
STATUS_TIMEOUT = 2.0
#: The first and the longest gap between ``is_paused`` polls (after ``/pause``, before a continuation).
POLL_FIRST, POLL_MAX = 0.02, 0.5
#: The first and the longest gap between version reads of an engine that did not answer at start-up.
VERSION_RETRY_FIRST, VERSION_RETRY_MAX = 1.0, 30.0


def engine_of(credential: Credential) -> Engine:
    """The engine behind a credential: its upstream's root, headers and this key."""
    upstream = credential.upstream
    headers = dict(upstream.headers)
    if credential.api_key:
        headers["authorization"] = f"Bearer {credential.api_key}"
    return Engine(upstream.name, engine_root(upstream.base_url), headers)


def fleet_of(pool: UpstreamPool) -> list[Engine]:
    """One engine per upstream with an engine API, in the pool's order (with the first
    credential that has a key)."""
    engines: dict[tuple[str, str], Engine] = {}
    for credential in pool.credentials:
        upstream = credential.upstream
        key = (upstream.name, upstream.base_url)
        if upstream.engine_api is None or key in engines and (
                not credential.api_key or "authorization" in engines[key].headers):
            continue
        engines[key] = engine_of(credential)
    return list(engines.values())


async def _bounded(bound: float, step: Callable[[], Awaitable[None]], late: str) -> str | None:
    """Run ``step`` within ``bound`` seconds: None, or why it failed."""
    try:
        async with asyncio.timeout(bound):
            await step()
    except TimeoutError:
        return late
    except EngineControlError as exc:
        return str(exc)
    return None


class EngineFleet:
    """Pause, resume and list the engines; the hold keeps new calls meanwhile."""

    def __init__(self, pool: Callable[[], UpstreamPool], control: EngineControl, hold: EngineHold,
                 on_paused: Callable[[str, bool], None] | None = None) -> None:
        self.pool = pool
        self.control = control
        self.hold = hold
        self._on_paused = on_paused or (lambda name, paused: None)
        #: called once per continuation sent after an abort (gateway/engines/continuation.py)
        self.on_continued: Callable[[], None] = lambda: None
        self._watches: dict[str, asyncio.Task[bool]] = {}  # engine root -> its /is_paused poller
        #: each engine's weight version as last reported (or set by a resume), by name
        self.versions: dict[str, str] = {}
        self._trails: dict[str, set[VersionTrail]] = {}  # engine name -> the attempts at it now
        self._askers: list[asyncio.Task[None]] = []  # start-up version reads still retrying

    def track(self, credential: Credential) -> VersionTrail | None:
        """An attempt at this credential's engine starts: its version trail (None for an
        upstream without an engine API), from the version known now."""
        name = credential.upstream.name
        if credential.upstream.engine_api is None:
            return None
        trail = VersionTrail(name)
        trail.switch(self.versions.get(name))
        self._trails.setdefault(name, set()).add(trail)
        return trail

    def untrack(self, trail: VersionTrail | None) -> None:
        if trail is not None:
            self._trails.get(trail.engine, set()).discard(trail)

    def _learn(self, name: str, version: str | None, switch: bool) -> None:
        """The engine's version now; ``switch``: the attempts at it run it from here on."""
        if version is None:
            return
        self.versions[name] = version
        for trail in self._trails.get(name, ()) if switch else ():
            trail.switch(version)

    async def learn_versions(self) -> None:
        """Ask every engine its version at start-up (2 s bound each). One that does not answer
        (an engine still loading its weights) is asked again in the background, 1 s then
        doubling to 30 s, until its version is known: otherwise the calls' records would carry
        no weight version until the trainer's first resume."""
        engines = self.engines()
        await asyncio.gather(*(self._ask_version(e, switch=False) for e in engines))
        self._askers += [asyncio.create_task(self._ask_until_known(e)) for e in engines if e.name not in self.versions]

    async def _ask_until_known(self, engine: Engine) -> None:
        gap = VERSION_RETRY_FIRST
        while engine.name not in self.versions:  # a resume or a status read may learn it first
            await asyncio.sleep(gap)
            gap = min(gap * 2, VERSION_RETRY_MAX)
            await self._ask_version(engine, switch=False)

    async def _ask_version(self, engine: Engine, switch: bool) -> None:
        async def step() -> None:
            self._learn(engine.name, await self.control.weight_version(engine), switch)

        await _bounded(STATUS_TIMEOUT, step, "")

    def engines(self) -> list[Engine]:
        return fleet_of(self.pool())

    async def pause(self, mode: str, bound: float) -> dict[str, str]:
        """Close the hold, pause every engine; the engines that did not report paused
        within ``bound`` seconds, with why (empty: all paused)."""
        self.hold.close()
        engines = self.engines()
        reasons = await asyncio.gather(*(self._pause_one(e, mode, bound) for e in engines))
        return {e.name: why for e, why in zip(engines, reasons, strict=True) if why is not None}

    async def _pause_one(self, engine: Engine, mode: str, bound: float) -> str | None:
        async def step() -> None:
            await self.control.pause(engine, mode)
            gap = POLL_FIRST
            while not await self.control.is_paused(engine):
                await asyncio.sleep(gap)
                gap = min(gap * 2, POLL_MAX)

        why = await _bounded(bound, step, f"not paused within {bound:g} s")
        if why is None:
            self._on_paused(engine.name, True)
        return why

    async def resume(self, weight_version: str | None, bound: float) -> tuple[dict[str, str], int]:
        """Set the weight version (when given) and resume every engine, then open the
        hold. The engines that failed (with why) and how many held calls were released;
        the hold opens whatever failed (a held call sent to a still-paused engine waits in
        its queue, as it would without the gateway)."""
        engines = self.engines()
        reasons = await asyncio.gather(*(self._resume_one(e, weight_version, bound) for e in engines))
        released = self.hold.open()
        return {e.name: why for e, why in zip(engines, reasons, strict=True) if why is not None}, released

    async def _resume_one(self, engine: Engine, weight_version: str | None, bound: float) -> str | None:
        async def step() -> None:
            # The attempts at this engine switch while it is still paused: a ``keep``-frozen
            # one has counted exactly the tokens of the old weights, and the first token
            # after the resume is the new version's (switched after, a few already counted).
            if weight_version is not None:
                await self.control.update_weight_version(engine, weight_version)
                self._learn(engine.name, weight_version, switch=True)
            await self._ask_version(engine, switch=True)  # the engine's own word wins
            await self.control.resume(engine)

        why = await _bounded(bound, step, f"not resumed within {bound:g} s")
        if why is None:
            self._on_paused(engine.name, False)
        return why

    async def accepting(self, credential: Credential, policy: StreamPolicy) -> str | None:
        """Before a continuation: wait while the gateway holds calls to this engine, then
        while the engine reports ``is_paused``; at most ``--engine-pause-max`` seconds
        each, then ``engine_paused``. An engine without an engine API, or one whose
        ``/is_paused`` does not answer, is asked at once (a paused engine queues the
        request itself). The engine's weight version then, when known."""
        upstream, bound = credential.upstream, policy.engine_pause_max
        if self.hold.holds(upstream.engine_api):
            await self.hold.wait(upstream.name, bound)
        if upstream.engine_api is None:
            return None
        engine = engine_of(credential)
        watch = self._watches.get(engine.root)
        if watch is None or watch.done():
            watch = self._watches[engine.root] = asyncio.create_task(self._watch(engine, bound))
        try:
            async with asyncio.timeout(bound):
                accepting = await asyncio.shield(watch)  # a cancelled waiter leaves the watch to the others
        except TimeoutError:
            accepting = False
        if not accepting:
            raise engine_paused(bound)
        return self.versions.get(upstream.name)

    async def _watch(self, engine: Engine, bound: float) -> bool:
        """One poller per engine, however many calls wait on it: ``/is_paused`` with
        backoff until false (True), or ``bound`` seconds (False)."""
        gap = POLL_FIRST
        try:
            async with asyncio.timeout(bound):
                while await self.control.is_paused(engine):
                    await asyncio.sleep(gap)
                    gap = min(gap * 2, POLL_MAX)
        except TimeoutError:
            return False
        except EngineControlError:
            return True
        await self._ask_version(engine, switch=False)  # what a continuation will run on
        return True

    async def aclose(self) -> None:
        """Stop the pollers (at shutdown)."""
        await stop_tasks(*self._watches.values(), *self._askers)
        self._watches.clear()
        self._askers.clear()

    async def status(self) -> list[dict[str, Any]]:
        """Each engine: url, paused, weight version (asked now), calls in flight, calls held."""
        engines = self.engines()
        return list(await asyncio.gather(*(self._status_one(e) for e in engines)))

    async def _status_one(self, engine: Engine) -> dict[str, Any]:
        in_flight = sum(c.in_flight for c in self.pool().credentials
                        if c.upstream.name == engine.name and engine_root(c.upstream.base_url) == engine.root)
        found: dict[str, Any] = {"paused": None, "weight_version": None}

        async def step() -> None:
            found["paused"] = await self.control.is_paused(engine)
            found["weight_version"] = await self.control.weight_version(engine)
            self._learn(engine.name, found["weight_version"], switch=False)

        why = await _bounded(STATUS_TIMEOUT, step, f"no status within {STATUS_TIMEOUT:g} s")
        return {"name": engine.name, "url": engine.url, **found, "in_flight": in_flight,
                "held": self.hold.held.get(engine.name, 0), "error": why}
