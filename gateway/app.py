"""The Starlette application: routes, and the lifespan that owns every long-lived part."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.protocols.base import ProtocolRoom
from gateway.protocols.chat import ChatRoom
from gateway.relay import Relay, RequestRecord
from gateway.servers import bind_loopback, start_embedded, stop_embedded
from gateway.store.db import Database
from gateway.settings import LiveSettings, Settings, Source, load_settings
from gateway.upstream.client import UpstreamClient, UpstreamTarget

log = structlog.get_logger("gateway")


class LogObserver:
    """Logs one line per finished request (the audit store and metrics join later)."""

    def on_start(self, record: RequestRecord) -> None:
        pass

    def on_finish(self, record: RequestRecord) -> None:
        log.info(
            "request",
            request_id=record.request_id,
            protocol=record.protocol,
            mode=record.mode,
            streamed=record.streamed,
            outcome=record.outcome,
            error_code=record.error_code,
            status=record.http_status,
            duration_ms=round(record.duration_ms, 1),
        )


def create_app(settings: Settings | None = None, sources: dict[str, Source] | None = None) -> Starlette:
    """Build the gateway. With no upstream URL configured, it starts the built-in
    simulator on a free loopback port and sends upstream traffic there."""
    if settings is None:
        settings, sources = load_settings()
    live = LiveSettings(settings, sources or {})
    db = Database(settings.data_dir / "codebuddy2api.sqlite3")
    upstream = UpstreamClient()
    targets: list[UpstreamTarget] = []

    def current_target() -> UpstreamTarget:
        return targets[0]

    relay = Relay(live, upstream, current_target, LogObserver())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        simulator = None
        if settings.upstream_url:
            key = settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
            targets.append(UpstreamTarget(settings.upstream_url, key))
        else:
            from gateway.upstream.simulator import create_simulator_app

            sock = bind_loopback()
            simulator = await start_embedded(create_simulator_app(), sock)
            targets.append(UpstreamTarget(f"http://127.0.0.1:{sock.getsockname()[1]}/v1"))
            app.state.simulator_url = targets[0].base_url
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await upstream.aclose()
            db.close()
            if simulator is not None:
                await stop_embedded(*simulator)

    def generation(room: ProtocolRoom):  # type: ignore[no-untyped-def]
        async def endpoint(request: Request) -> Response:
            return await relay.handle(room, request)  # type: ignore[return-value]

        return endpoint

    async def healthz(request: Request) -> Response:
        if getattr(request.app.state, "ready", False):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "starting"}, status_code=503)

    routes = [
        Route("/v1/chat/completions", generation(ChatRoom()), methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.live = live
    app.state.db = db
    app.state.relay = relay
    app.state.ready = False
    return app
