"""The client of one engine's control API: vLLM's dev RL API at the server root (not
under /v1): ``POST /pause?mode=``, ``POST /resume``, ``GET /is_paused``, ``GET
/weight_info``, ``POST /update_weight_version`` (PROTOCOLS.md, "Fleets and weight updates"),
and ``POST /abort_requests`` (a rollout's abort, gateway/admin/rollout_abort_api.py).

Each call is bounded by the caller (``asyncio.timeout`` around it) and by httpx's own
timeouts; a failure is an ``EngineControlError`` naming the engine and what went wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.upstream.urls import without_userinfo


class EngineControlError(Exception):
    """An engine's control endpoint failed or answered something unexpected."""


def engine_root(base_url: str) -> str:
    """The server root of an OpenAI-compatible base URL (``http://h:8000/v1`` ->
    ``http://h:8000``): vLLM serves its dev RL API there."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


@dataclass(frozen=True)
class Engine:
    """One engine as the fleet sees it: the upstream's name, its root URL, and the headers
    its calls carry (the upstream's own, and its first credential's key)."""

    name: str
    root: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        """The root URL as shown to the admin (never a password)."""
        return without_userinfo(self.root)


class EngineControl:
    """vLLM's dev RL API over one shared httpx client (opened with the app's lifespan,
    or injected: ``httpx.MockTransport`` in unit tests)."""

    def __init__(self, http: httpx.AsyncClient | None = None) -> None:
        self.http = http

    def open(self) -> None:
        if self.http is None:  # no read timeout: each call is bounded by its caller
            self.http = httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=None))

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None

    async def _call(self, engine: Engine, method: str, path: str, *, answer: bool = True,
                    **kwargs: Any) -> dict[str, Any]:
        """``answer``: the reply must be a JSON object (else any 200 will do: an empty dict)."""
        if self.http is None:
            raise EngineControlError(f"{method} {path}: the gateway is not serving")
        try:
            response = await self.http.request(method, engine.root + path, headers=engine.headers, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineControlError(f"{method} {path}: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise EngineControlError(f"{method} {path}: HTTP {response.status_code}")
        if not answer:
            return {}
        try:
            body = response.json()
        except ValueError:
            raise EngineControlError(f"{method} {path}: the answer is not JSON") from None
        if not isinstance(body, dict):
            raise EngineControlError(f"{method} {path}: the answer is not a JSON object")
        return body

    async def pause(self, engine: Engine, mode: str) -> None:
        await self._call(engine, "POST", "/pause", params={"mode": mode})

    async def resume(self, engine: Engine) -> None:
        await self._call(engine, "POST", "/resume")

    async def is_paused(self, engine: Engine) -> bool:
        paused = (await self._call(engine, "GET", "/is_paused")).get("is_paused")
        if not isinstance(paused, bool):
            raise EngineControlError("GET /is_paused: no boolean is_paused")
        return paused

    async def weight_version(self, engine: Engine) -> str | None:
        version = (await self._call(engine, "GET", "/weight_info")).get("weight_version")
        return version if isinstance(version, str) else None

    async def update_weight_version(self, engine: Engine, version: str) -> None:
        await self._call(engine, "POST", "/update_weight_version", json={"weight_version": version})

    async def abort_requests(self, engine: Engine, request_ids: list[str]) -> None:
        """End these requests (the ``X-Request-Id`` each was sent with) in the engine."""
        await self._call(engine, "POST", "/abort_requests", json={"request_ids": request_ids}, answer=False)
