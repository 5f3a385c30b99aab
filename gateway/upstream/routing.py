"""Which replica serves a call: session affinity, a prefix index, load and an imbalance gate.

Every credential that can serve a model is a *replica* of one pool (with several
``--upstream-url`` s, one engine each). The pool hands a router the replicas usable now
(enabled, not cooling down, under their cap, healthy first) and the router picks one,
with the reason it did (docs/routing.md):

- ``cache-aware`` (:class:`CacheAwareRouter`): a call that names a session goes where
  that session went last (``session``); one that does not, to the replica whose sent
  prompts share the longest prefix with it (``prefix``); otherwise, and on ties, the one
  with the fewest calls in flight through this gateway (``least_loaded``), each call
  counted as many times as its replica is slower than the fastest lately (:class:`Pace`),
  plus the requests the engine itself says it queues (:class:`EngineLoad`, vLLM's
  ``/metrics``). Two gates send the call to the least-loaded replica (``rebalanced``):
  load, when the chosen one holds more than ``min * rel + abs`` of them; pace, when the
  chosen one is *slow* (its pace more than ``slow_factor`` times the fastest's: slow
  replicas are left out of every choice while another is usable). A session whose
  replica is not usable any more, or a retry after a failed attempt, is ``failover``.
  The session moves with the call each time.
- ``round-robin`` (:class:`RoundRobinRouter`): the pool's behaviour before routing
  existed: a named session sticks to its replica while usable, else the next in turn.

Both are pure: fed the candidates, a session and a prefix chain one call at a time, with
a clock for the session map; no I/O.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

#: Stickiness (session -> replica) is bounded: at most this many sessions, each forgotten
#: after this many seconds without a call (least recently used go first).
STICKY_MAX_SESSIONS = 10_000
STICKY_TTL_SECONDS = 3600.0
#: Prefix hashes remembered per replica (LRU); one per message of each prompt sent.
PREFIX_ENTRIES_PER_REPLICA = 50_000
#: Strings longer than twice this are hashed by length, head and tail (the index's cost
#: per message stays bounded; two prompts that differ only mid-way in one long message
#: look alike, which costs at worst a less warm replica, never a wrong answer).
SAMPLE_CHARS = 1024

#: The weight of a new answer's time in a replica's pace (an exponentially weighted mean),
#: and the most a slow replica's calls count for (a replica 10x slower counts 10 a call).
PACE_WEIGHT = 0.2
PACE_CAP = 10.0
#: A replica's pace counts once it has this many answers (the first ones, a cold start's
#: queue, say little), and is forgotten after this many seconds without one (a replica
#: that was left because it was slow is tried again: it may have recovered).
PACE_MIN_SAMPLES = 3
PACE_STALE_SECONDS = 60.0
#: Means under this many seconds count as this: among calls that quick the differences are
#: noise (a connection's set-up, a busy event loop), not an engine's pace.
PACE_FLOOR_SECONDS = 0.25
#: ``--routing-slow-factor``: a replica whose pace is more than this many times the
#: fastest usable one's is *slow*: its sessions leave it and nothing new goes there
#: while a brisker replica is usable (0: off).
SLOW_FACTOR = 3.0
#: An engine's own report of its queue (vLLM ``/metrics``, gateway/engines/load.py) counts
#: for this many seconds after it was read (the poller reads every 2 s).
ENGINE_LOAD_STALE_SECONDS = 10.0

ROUTING_MODES = ("cache-aware", "round-robin")
#: Every reason a router gives (the label values of codebuddy2api_routing_decisions_total).
REASONS = ("session", "prefix", "least_loaded", "rebalanced", "failover", "round_robin")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine says of its own load: requests queued (not yet running) and the
    share of its KV cache running requests hold (None: not reported)."""

    waiting: float
    kv_cache_usage: float | None = None


class Replica(Protocol):
    """What a router reads of a replica (a Credential in the gateway)."""

    @property
    def id(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


R = TypeVar("R", bound=Replica)


@dataclass(frozen=True, slots=True)
class Route(Generic[R]):
    """The replica chosen for one attempt and why (one of :data:`REASONS`)."""

    replica: R
    reason: str


class StickySessions:
    """session -> replica id, bounded by count (LRU) and by idle time (TTL)."""

    def __init__(
        self, clock: Callable[[], float], max_sessions: int = STICKY_MAX_SESSIONS, ttl: float = STICKY_TTL_SECONDS
    ) -> None:
        self.clock = clock
        self.max_sessions = max_sessions
        self.ttl = ttl
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session: str) -> str | None:
        entry = self._entries.get(session)
        if entry is None:
            return None
        if self.clock() - entry[1] > self.ttl:
            del self._entries[session]
            return None
        return entry[0]

    def put(self, session: str, replica_id: str) -> None:
        now = self.clock()
        self._entries[session] = (replica_id, now)
        self._entries.move_to_end(session)
        entries = self._entries
        while entries:
            oldest, (_, used) = next(iter(entries.items()))
            if len(entries) <= self.max_sessions and now - used <= self.ttl:
                break
            del entries[oldest]


class PrefixIndex:
    """Per replica, an LRU set of the prefix hashes of the prompts sent to it.

    A prompt's chain is one hash per message, each covering every message before it
    (:func:`prefix_chain`). A chain is recorded longest prefix first, so a shorter prefix
    is always used more recently than a longer one of the same prompt and LRU eviction
    takes the longer first: each replica's set stays prefix-closed, and the longest match
    is a binary search.
    """

    def __init__(self, max_per_replica: int = PREFIX_ENTRIES_PER_REPLICA) -> None:
        self.max_per_replica = max_per_replica
        self._sent: dict[str, OrderedDict[int, None]] = {}

    def size(self, replica_id: str) -> int:
        return len(self._sent.get(replica_id, ()))

    def record(self, replica_id: str, chain: Sequence[int]) -> None:
        sent = self._sent.setdefault(replica_id, OrderedDict())
        for key in reversed(chain):
            sent[key] = None
            sent.move_to_end(key)
        while len(sent) > self.max_per_replica:
            sent.popitem(last=False)

    def match(self, replica_id: str, chain: Sequence[int]) -> int:
        """How many leading messages of ``chain`` this replica was sent (0: none)."""
        sent = self._sent.get(replica_id)
        if not sent:
            return 0
        low, high = 0, len(chain)  # chain[:low] matched; chain[high:] does not
        while low < high:
            mid = (low + high + 1) // 2
            if chain[mid - 1] in sent:
                low = mid
            else:
                high = mid - 1
        return low

    def forget(self, replica_id: str) -> None:
        self._sent.pop(replica_id, None)


class Pace:
    """How long each replica has lately taken to answer a call in full (an exponentially
    weighted mean), and so how much slower than the fastest each one is.

    An engine that slows down (a noisy neighbour, a throttled GPU) holds no more calls
    than the others when each session waits for its answer before the next turn: counted
    in calls alone it looks as loaded as the rest, and the sessions on it stay. Weighted
    by its pace, it looks as loaded as it is. Replicas see the same kind of calls, so
    their means compare; a replica without a mean yet (fewer than ``min_samples``
    answers, or none for ``stale`` seconds) counts as the fastest, and a mean under
    ``floor`` seconds as ``floor``.
    """

    def __init__(self, clock: Callable[[], float] = lambda: 0.0, weight: float = PACE_WEIGHT,
                 cap: float = PACE_CAP, min_samples: int = PACE_MIN_SAMPLES, stale: float = PACE_STALE_SECONDS,
                 floor: float = PACE_FLOOR_SECONDS) -> None:
        self.clock = clock
        self.floor = floor
        self.weight = weight
        self.cap = cap
        self.min_samples = min_samples
        self.stale = stale
        self._mean: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._last: dict[str, float] = {}  # when each replica last answered (the clock's time)

    def observe(self, replica_id: str, seconds: float) -> None:
        now = self.clock()
        if now - self._last.get(replica_id, now) > self.stale:
            self.forget(replica_id)  # an old mean says nothing of the replica now
        count = self._count[replica_id] = self._count.get(replica_id, 0) + 1
        old = self._mean.get(replica_id, seconds)
        # the first answers are averaged plainly (no bias towards the very first one)
        self._mean[replica_id] = old + max(self.weight, 1 / count) * (seconds - old)
        self._last[replica_id] = now

    def forget(self, replica_id: str) -> None:
        self._mean.pop(replica_id, None)
        self._count.pop(replica_id, None)
        self._last.pop(replica_id, None)

    def slowness(self, replica_ids: Sequence[str]) -> dict[str, float]:
        """replica id -> its mean over the fastest mean among them, from 1 to ``cap``."""
        now = self.clock()
        means = {r: max(self.floor, self._mean[r]) for r in replica_ids
                 if self._count.get(r, 0) >= self.min_samples and now - self._last[r] <= self.stale}
        fastest = min(means.values(), default=0.0)
        if fastest <= 0:
            return dict.fromkeys(replica_ids, 1.0)
        return {r: min(self.cap, max(1.0, means.get(r, fastest) / fastest)) for r in replica_ids}


class CacheAwareRouter:
    """Session, then prefix, then least in flight, among the replicas that are not slow;
    the load gate over all three."""

    uses_prefix = True

    def __init__(
        self, clock: Callable[[], float], imbalance_rel: float = 1.5, imbalance_abs: int = 8,
        sessions: StickySessions | None = None, index: PrefixIndex | None = None, slow_factor: float = SLOW_FACTOR,
    ) -> None:
        self.imbalance_rel = imbalance_rel
        self.imbalance_abs = imbalance_abs
        self.slow_factor = slow_factor
        self.sessions = StickySessions(clock) if sessions is None else sessions  # (an empty one is falsy)
        self.index = PrefixIndex() if index is None else index
        self.pace = Pace(clock)
        self.clock = clock
        self.reported: dict[str, tuple[EngineLoad, float]] = {}  # replica id -> its own report, when read
        self._turn = itertools.count()  # spreads ties (e.g. new sessions while all are idle)

    def route(self, candidates: Sequence[R], session: str | None = None, prefix: Sequence[int] = (),
              failover: bool = False) -> Route[R]:
        """Pick one of ``candidates`` (non-empty) for a call and learn from the choice:
        the session now lives there and its prompt is in that replica's index.
        ``failover``: a retry after an attempt that failed before its first byte."""
        slowness = self.pace.slowness([c.id for c in candidates])
        queued = self._queued()
        loads = {c.id: c.in_flight * slowness[c.id] + queued.get(c.id, 0.0) for c in candidates}
        brisk = self._brisk(candidates, slowness)
        chosen: R | None = None
        reason = ""
        if session is not None:
            known = self.sessions.get(session)
            if known is not None:
                chosen = next((c for c in candidates if c.id == known), None)
                reason = "session" if chosen is not None else "failover"
                if chosen is not None and chosen not in brisk:  # its replica became slow: it leaves
                    chosen, reason = None, "rebalanced"
        if chosen is None and prefix:
            matches = {c.id: self.index.match(c.id, prefix) for c in candidates}
            best = max(matches[c.id] for c in brisk)
            if max(matches.values()) > best:  # its warmest replica is slow: it leaves
                reason = reason or "rebalanced"
            if best and min(matches[c.id] for c in brisk) < best:  # a match every replica has tells nothing
                chosen = self._least_loaded([c for c in brisk if matches[c.id] == best], loads)
                reason = reason or "prefix"
        if chosen is None:
            chosen = self._least_loaded(brisk, loads)
            reason = reason or "least_loaded"
        if failover:
            reason = "failover"
        if loads[chosen.id] > min(loads[c.id] for c in brisk) * self.imbalance_rel + self.imbalance_abs:
            chosen, reason = self._least_loaded(brisk, loads), "rebalanced"
        if session is not None:
            self.sessions.put(session, chosen.id)
        if prefix:
            self.index.record(chosen.id, prefix)
        return Route(chosen, reason)

    def observe(self, replica_id: str, seconds: float) -> None:
        """A call on ``replica_id`` was answered in full in ``seconds``."""
        self.pace.observe(replica_id, seconds)

    def report_load(self, replica_id: str, load: EngineLoad) -> None:
        """The engine's own report of its load (gateway/engines/load.py)."""
        self.reported[replica_id] = (load, self.clock())

    def forget(self, replica_id: str) -> None:
        """The replica left the pool: its index, pace and report go (its sessions fail over)."""
        self.index.forget(replica_id)
        self.pace.forget(replica_id)
        self.reported.pop(replica_id, None)

    def _queued(self) -> dict[str, float]:
        """Requests each engine says it queues, from reports read lately (none: 0)."""
        if not self.reported:
            return {}
        now = self.clock()
        return {r: load.waiting for r, (load, at) in self.reported.items() if now - at <= ENGINE_LOAD_STALE_SECONDS}

    def _brisk(self, candidates: Sequence[R], slowness: Mapping[str, float]) -> list[R]:
        """The candidates not slow (their pace within ``slow_factor`` of the fastest's):
        never empty, the fastest is always among them."""
        if not self.slow_factor:
            return list(candidates)
        return [c for c in candidates if slowness[c.id] <= self.slow_factor]

    def _least_loaded(self, candidates: Sequence[R], loads: Mapping[str, float]) -> R:
        """The fewest calls in flight, each weighted by its replica's slowness; ties in turn."""
        least = min(loads[c.id] for c in candidates)
        tied = [c for c in candidates if loads[c.id] == least]
        return tied[0] if len(tied) == 1 else tied[next(self._turn) % len(tied)]


class RoundRobinRouter:
    """The pool's behaviour before routing: a session sticks while its replica is usable,
    everything else takes the next replica in turn."""

    uses_prefix = False

    def __init__(self, clock: Callable[[], float], sessions: StickySessions | None = None) -> None:
        self.sessions = StickySessions(clock) if sessions is None else sessions
        self._turn = itertools.count()

    def route(self, candidates: Sequence[R], session: str | None = None, prefix: Sequence[int] = (),
              failover: bool = False) -> Route[R]:
        chosen: R | None = None
        reason = "round_robin"
        if session is not None:
            known = self.sessions.get(session)
            chosen = next((c for c in candidates if c.id == known), None) if known else None
            reason = "session" if chosen is not None else ("failover" if known else reason)
        if chosen is None:
            chosen = candidates[next(self._turn) % len(candidates)]
        if failover:
            reason = "failover"
        if session is not None:
            self.sessions.put(session, chosen.id)
        return Route(chosen, reason)

    def observe(self, replica_id: str, seconds: float) -> None:
        """Round-robin does not look at speed."""

    def report_load(self, replica_id: str, load: EngineLoad) -> None:
        """Nor at the engines' own load."""

    def forget(self, replica_id: str) -> None:
        """Nothing kept per replica but the sessions' (they fail over)."""


Router = CacheAwareRouter | RoundRobinRouter


class Engine(Generic[R]):
    """One engine (an upstream base URL) and its usable credentials: what a router routes
    over. Several keys of one upstream reach the same engine, so they share its prefix
    cache: affinity is per engine, and within it the calls are spread over the keys (the
    fewest in flight, ties in turn), so a key's traffic is never skewed by routing."""

    __slots__ = ("id", "credentials")

    def __init__(self, engine_id: str, credentials: list[R]) -> None:
        self.id = engine_id
        self.credentials = credentials

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.credentials)

    def pick(self, turn: int) -> R:
        least = min(c.in_flight for c in self.credentials)
        tied = [c for c in self.credentials if c.in_flight == least]
        return tied[turn % len(tied)]


def engines_of(candidates: Sequence[R], engine_id: Callable[[R], str]) -> list[Engine[R]]:
    """``candidates`` grouped by engine, in their order of first appearance."""
    grouped: dict[str, list[R]] = {}
    for c in candidates:
        grouped.setdefault(engine_id(c), []).append(c)
    return [Engine(key, members) for key, members in grouped.items()]


def build_router(mode: str, clock: Callable[[], float], imbalance_rel: float = 1.5,
                 imbalance_abs: int = 8, slow_factor: float = SLOW_FACTOR) -> Router:
    if mode == "round-robin":
        return RoundRobinRouter(clock)
    return CacheAwareRouter(clock, imbalance_rel, imbalance_abs, slow_factor=slow_factor)


# -- the prefix chain of a chat body --------------------------------------------------------


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a JSON value whose cost is bounded per string."""
    if isinstance(value, str):
        return value if len(value) <= 2 * SAMPLE_CHARS else (len(value), value[:SAMPLE_CHARS], value[-SAMPLE_CHARS:])
    if isinstance(value, dict):  # JSON-decoded: dict and list, never other mappings
        return tuple([(k, _frozen(v)) for k, v in value.items()])
    if isinstance(value, list):
        return tuple([_frozen(v) for v in value])
    return value


def prefix_chain(body: Mapping[str, Any]) -> tuple[int, ...]:
    """One hash per message of a chat body, each covering the model, the tools and every
    message up to it: two prompts share the first n hashes when they share the first n
    messages (and model and tools). Hashes are this process's own (``hash``): the index
    lives in one process."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ()
    running = hash((body.get("model"), _frozen(body.get("tools"))))
    chain = []
    for message in messages:
        running = hash((running, _frozen(message)))
        chain.append(running)
    return tuple(chain)
