"""State shared by replicas: heartbeats, capacity shares and credential health polling.

Every replica (a process with its own event loop: a ``--workers`` worker or a gateway on
another machine) on a shared store runs one background thread, :class:`Replication`,
that every :data:`CREDENTIAL_POLL` seconds re-reads ``credential_state`` (and credentials
added through the admin API) and hands changes to the pool on the event loop, and every
:data:`HEARTBEAT_INTERVAL` seconds upserts its row in ``replicas`` and reads which
replicas are alive (heartbeat within :data:`REPLICA_TTL`, by the database's clock).

Capacity: :class:`SharedCapacity` gives each live replica a fixed share of
``max_concurrent``: ``floor(max / n)``, plus one for the first ``max % n`` replicas in
replica-id order, so the shares add up to exactly ``max_concurrent``. Admission stays a
local counter check (no database round trip per request). docs/scaling.md explains the
choice and the tolerance while replicas join or leave.

Nothing here does I/O on the event loop except :meth:`Replication.start` / ``aclose``
(each one short query, in a worker thread).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import orjson
import structlog

from gateway.store.credentials import CredentialState
from gateway.store.db import Store
from gateway.store.migrations import MIGRATIONS

if TYPE_CHECKING:
    from gateway.upstream.pool import UpstreamPool

log = structlog.get_logger("gateway.replicas")

#: Seconds between heartbeats; a replica silent for REPLICA_TTL is no longer counted.
HEARTBEAT_INTERVAL = 1.0
REPLICA_TTL = 5.0
#: Seconds between polls of credential health (cooldowns, disabled) written by others.
CREDENTIAL_POLL = 0.5
#: Seconds the goodbye (deleting this replica's row) may take at shutdown.
LEAVE_TIMEOUT = 5.0
#: Heartbeat rows older than this are deleted (crashed replicas never say goodbye).
FORGET_AFTER = 3600.0
#: The store schema this version runs (its last migration), in every heartbeat: what a
#: replica of another version can tell about it (a version from before has none).
SCHEMA = MIGRATIONS[-1][0]
#: The first schema whose code enforces managed client keys (migration 10).
MANAGED_KEYS_SCHEMA = 10


def without_managed_keys(members: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live replicas that may not enforce managed keys: those of a version that does
    not say its schema in its heartbeat (before this one; those from migration 10 on do
    enforce them, but their heartbeat cannot tell), or says one before migration 10."""
    return [m for m in members if int(m.get("schema") or 0) < MANAGED_KEYS_SCHEMA]

_BEAT = (
    "INSERT INTO replicas (replica_id, started_at, heartbeat_at, in_flight, info) VALUES (?, ?, {now}, ?, ?) "
    "ON CONFLICT (replica_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at, "
    "in_flight = excluded.in_flight, info = excluded.info"
)


def default_replica_id() -> str:
    """host-pid-random: unique per process, readable in the replicas table."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Poller:
    """Calls ``fn`` every ``interval`` seconds in a daemon thread until stopped; an
    exception is logged and the next tick tries again (last known values stay in force)."""

    def __init__(self, name: str, interval: float, fn: Callable[[], None]) -> None:
        self.interval = interval
        self.fn = fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._failing = False

    def start(self) -> Poller:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.fn()
                if self._failing:
                    log.info("poll_recovered", poller=self._thread.name)
                self._failing = False
            except Exception as exc:  # a database outage must not kill the thread
                if not self._failing:
                    log.warning("poll_failed", poller=self._thread.name, error=f"{type(exc).__name__}: {exc}")
                self._failing = True

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


class CapacityPolicy(Protocol):
    """What the relay asks for the number of requests this process may run at once."""

    def limit(self, max_concurrent: int) -> int: ...


def share(max_concurrent: int, replicas: list[str], me: str) -> int:
    """This replica's part of ``max_concurrent`` among ``replicas`` (shares sum to it)."""
    live = sorted(set(replicas) | {me})
    base, extra = divmod(max_concurrent, len(live))
    return base + (1 if live.index(me) < extra else 0)


class SharedCapacity:
    """A fixed share of the global cap, from the last heartbeat's view of live replicas."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.live: list[str] = [replica_id]

    def limit(self, max_concurrent: int) -> int:
        return share(max_concurrent, self.live, self.replica_id)


def standalone_status(replica_id: str | None, max_concurrent: int, in_flight: int) -> dict[str, Any]:
    """The status of a gateway that shares its store with no one: the whole cap is its own."""
    me = {"replica_id": replica_id or "standalone", "in_flight": in_flight, "pid": os.getpid(),
          "host": socket.gethostname(), "max_concurrent_share": max_concurrent}
    return {"replica_id": me["replica_id"], "shared": False, "max_concurrent_share": max_concurrent, "live": [me]}


class Replication:
    """One replica's membership and shared-state polling (see the module docstring)."""

    def __init__(
        self,
        db: Store,
        replica_id: str | None = None,
        in_flight: Callable[[], int] = lambda: 0,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        ttl: float = REPLICA_TTL,
        credential_poll: float = CREDENTIAL_POLL,
    ) -> None:
        self.db = db
        self.replica_id = replica_id or default_replica_id()
        self.in_flight = in_flight
        self.heartbeat_interval = heartbeat_interval
        self.ttl = ttl
        self.credential_poll = credential_poll
        self.capacity = SharedCapacity(self.replica_id)
        self.credentials = CredentialState(db)
        self.started_at = time.time()
        self.pool: UpstreamPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: Poller | None = None
        self._last_beat = 0.0
        #: the live replicas as the last heartbeat read them (the status API shows them;
        #: memory only, so no request waits on the store)
        self.members: list[dict[str, Any]] = []

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, pool: UpstreamPool | None = None) -> None:
        """Join: one heartbeat (so shares count this replica before it admits anything),
        then the background thread."""
        self.pool = pool
        self._loop = asyncio.get_running_loop()
        await self.db.acall(self.heartbeat)
        tick = min(self.credential_poll, self.heartbeat_interval)
        self._poller = Poller(f"replica-sync-{self.replica_id}", tick, self._tick).start()

    async def aclose(self) -> None:
        """Leave: stop polling and delete this replica's row, so the others take its
        share at their next heartbeat instead of after the TTL."""
        if self._poller is not None:
            await asyncio.to_thread(self._poller.stop)
            self._poller = None
        try:  # bounded: a stalled store must not hold the exit (the row then ages out by TTL)
            async with asyncio.timeout(LEAVE_TIMEOUT):
                await self.db.acall(self.db.execute, "DELETE FROM replicas WHERE replica_id = ?", (self.replica_id,))
        except (*self.db.errors, TimeoutError) as exc:
            log.warning("replica_leave_failed", error=type(exc).__name__)

    # -- the background thread -----------------------------------------------------------

    def _tick(self) -> None:
        if self.pool is not None:
            self.poll_credentials()
        if time.monotonic() - self._last_beat >= self.heartbeat_interval * 0.95:
            self.heartbeat()

    def _usable_credentials(self) -> int | None:
        """How many of this replica's credentials are enabled and not cooling down (read
        from this thread while the loop may change them: a torn read is skipped), so
        replicas that disagree on them show it side by side."""
        if self.pool is None:
            return None
        now = time.time()
        try:
            return sum(1 for c in list(self.pool.credentials)
                       if not c.disabled and not any(until > now for until in list(c.cooldowns.values())))
        except RuntimeError:  # changed while read
            return None

    def heartbeat(self) -> list[str]:
        """Record this replica as alive; returns (and adopts) the live replica ids."""
        info = orjson.dumps({"pid": os.getpid(), "host": socket.gethostname(), "schema": SCHEMA,
                             "credentials_usable": self._usable_credentials()}).decode()
        now = self.db.now_sql

        def beat(conn: Any) -> list[tuple[Any, ...]]:
            conn.execute(
                _BEAT.format(now=now),
                (self.replica_id, self.started_at, int(self.in_flight()), info),
            )
            conn.execute(f"DELETE FROM replicas WHERE heartbeat_at < {now} - ?", (FORGET_AFTER,))
            return conn.execute(  # type: ignore[no-any-return]
                f"SELECT replica_id, started_at, {now} - heartbeat_at, in_flight, info FROM replicas"
                f" WHERE heartbeat_at >= {now} - ? ORDER BY replica_id", (self.ttl,)
            ).fetchall()

        rows = self.db.run_tx(beat)
        self.members = [
            {"replica_id": rid, "started_at": float(started), "heartbeat_age": round(max(0.0, float(age)), 3),
             "in_flight": int(n), **orjson.loads(meta)}
            for rid, started, age, n, meta in rows
        ]
        live = [str(r[0]) for r in rows]
        if self._last_beat and time.monotonic() - self._last_beat > self.ttl:
            # back after an outage: the others' rows look dead until they beat again too;
            # keep counting the replicas we knew for this round (the cap's safe side)
            live = sorted(set(live) | set(self.capacity.live))
        self._last_beat = time.monotonic()
        if sorted(live) != sorted(self.capacity.live):
            log.info("replicas_changed", replica_id=self.replica_id, live=len(live))
        self.capacity.live = live
        return live

    def poll_credentials(self) -> None:
        """Read every credential's shared state (and admin-added credentials) and apply
        what changed on the event loop, where the pool lives."""
        states = self.credentials.load_versions()
        added = self.credentials.added_credentials()
        pool, loop = self.pool, self._loop
        if pool is None or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(pool.apply_shared, states, added)
        except RuntimeError:  # the loop closed meanwhile (shutdown)
            pass

    def status(self, max_concurrent: int) -> dict[str, Any]:
        """This replica and the live ones (from the last heartbeat, no I/O), each with its
        share of ``max_concurrent``: what ``/admin/api/status`` shows."""
        live = self.capacity.live
        members = [m | {"max_concurrent_share": share(max_concurrent, live, m["replica_id"])}
                   for m in self.members if m["replica_id"] in live]
        return {
            "replica_id": self.replica_id,
            "shared": True,
            "max_concurrent_share": self.capacity.limit(max_concurrent),
            "live": members,
        }

    def live_members(self) -> list[dict[str, Any]]:
        """The live replicas as of the last heartbeat (no I/O)."""
        live = set(self.capacity.live)
        return [m for m in self.members if m["replica_id"] in live]

    def replicas(self) -> list[dict[str, Any]]:
        """Every replica row with its age in seconds (for status pages and tests)."""
        rows = self.db.execute(
            f"SELECT replica_id, started_at, {self.db.now_sql} - heartbeat_at, in_flight, info FROM replicas"
            " ORDER BY replica_id"
        )
        return [
            {"replica_id": rid, "started_at": started, "age": float(age), "in_flight": int(n),
             "alive": float(age) <= self.ttl, **orjson.loads(info)}
            for rid, started, age, n, info in rows
        ]
