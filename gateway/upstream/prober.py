"""Self-healing credentials: a credential an upstream 401/403 disabled is probed again in
the background, with backoff, and re-enabled as soon as its key works.

The probe is ``GET {base_url}/models`` with that key (:meth:`UpstreamClient.probe`): cheap,
no tokens spent, and refused exactly when the key is. The first probe comes
``first_wait`` seconds after the credential went out, each failure doubles the wait up to
``max_wait``. A credential an admin disabled is never probed. What the pool learns (last
probe, next probe, failures) is shown by the admin API and the WebUI.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from gateway.tasks import stop_tasks

if TYPE_CHECKING:
    from gateway.upstream.client import UpstreamClient
    from gateway.upstream.credential import Credential
    from gateway.upstream.pool import UpstreamPool

log = structlog.get_logger("gateway.prober")

MAX_PROBE_WAIT = 300.0


def backoff(first_wait: float, failures: int, max_wait: float = MAX_PROBE_WAIT) -> float:
    """Seconds until the next probe after ``failures`` failed ones."""
    return min(max_wait, first_wait * (2 ** max(0, failures)))


class CredentialProber:
    """One background task probing the pool's upstream-disabled credentials."""

    def __init__(
        self,
        pool: Callable[[], UpstreamPool],
        client: UpstreamClient,
        first_wait: float,
        max_wait: float = MAX_PROBE_WAIT,
    ) -> None:
        self.pool = pool
        self.client = client
        self.first_wait = first_wait
        self.max_wait = max(max_wait, first_wait)
        self.probes = 0
        self._task: asyncio.Task[None] | None = None
        self._probing: set[str] = set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="credential-prober")

    async def aclose(self) -> None:
        await stop_tasks(self._task)

    async def _run(self) -> None:
        tick = min(1.0, self.first_wait / 2)
        while True:
            await asyncio.sleep(tick)
            pool = self.pool()
            due = [c for c in probes_due(pool.credentials, pool.clock(), self.first_wait) if c.id not in self._probing]
            if due:
                await asyncio.gather(*(self.probe(pool, c) for c in due))

    async def probe(self, pool: UpstreamPool, credential: Credential) -> None:
        self._probing.add(credential.id)
        try:
            ok, result = await self.client.probe(credential)
        except Exception as exc:  # a bug of ours must not stop probing
            ok, result = False, type(exc).__name__
        finally:
            self._probing.discard(credential.id)
        self.probes += 1
        wait = backoff(self.first_wait, credential.probe_failures + 1, self.max_wait)
        if not ok:
            log.info("credential_probe_failed", credential=credential.id, result=result, next_in_s=wait)
        learn_from_probe(pool, credential, ok, result, wait)


def probes_due(credentials: list[Credential], now: float, first_wait: float) -> list[Credential]:
    """Credentials an upstream 401/403 disabled whose next probe is due (an admin's
    disable is never probed away)."""
    due = []
    for credential in credentials:
        if not credential.disabled or credential.disabled_by != "upstream":
            continue
        if credential.next_probe_at is None:
            credential.next_probe_at = (credential.disabled_at or now) + first_wait
        if credential.next_probe_at <= now:
            due.append(credential)
    return due


def learn_from_probe(pool: UpstreamPool, credential: Credential, ok: bool, result: str, next_wait: float) -> None:
    """Learn from a probe: re-enable on success, else probe again in ``next_wait`` s."""
    now = pool.clock()
    credential.last_probe_at, credential.last_probe_result = now, result
    if not (credential.disabled and credential.disabled_by == "upstream"):
        return  # an admin acted meanwhile
    if ok:
        log.info("credential_recovered", credential=credential.id, out_for_s=round(now - (credential.disabled_at or now), 1))
        pool.enable(credential.id)
        return
    credential.probe_failures += 1
    credential.next_probe_at = now + next_wait
