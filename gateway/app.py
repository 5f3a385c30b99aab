"""The Starlette application: routes, and the lifespan that owns every long-lived part."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.protocols.base import ProtocolRoom
from gateway.protocols.chat import ChatRoom
from gateway.protocols.responses import ResponsesRoom
from gateway.protocols.messages import MessagesRoom
from gateway.admin import admin_mount, auth_routes
from gateway.observability.observer import Observability, metrics_endpoint
from gateway.models_api import keyed, list_models
from gateway.protocols.openai_shapes import error_json as openai_error
from gateway.protocols.messages import error_json as anthropic_error
from gateway.relay import GenerationService
from gateway.routes import count_tokens_endpoint, generation_endpoint, retrieve_response_endpoint
from gateway.servers import bind_loopback, start_embedded, stop_embedded
from gateway.store.db import open_database
from gateway.store.responses import ResponseStore
from gateway.store.saved_settings import SavedSettings
from gateway.settings import LiveSettings, Settings, Source, load_settings
from gateway.store.credentials import CredentialState
from gateway.store.replicas import Replication
from gateway.upstream.client import UpstreamClient
from gateway.upstream.config import build_pool
from gateway.capture import CaptureWriter

log = structlog.get_logger("gateway")

#: The WebUI's static files (plain HTML/CSS/JS, no build step), beside the package.
WEBUI_DIR = Path(__file__).resolve().parent.parent / "webui"


def webui_routes() -> list[BaseRoute]:
    """``/ui/`` serves the WebUI and ``/`` redirects there (absent from a wheel without it)."""
    if not (WEBUI_DIR / "index.html").is_file():
        return []

    async def home(request: Request) -> Response:
        return RedirectResponse("/ui/", status_code=307)

    return [Route("/", home, methods=["GET"]), Mount("/ui", app=StaticFiles(directory=WEBUI_DIR, html=True))]


def create_app(settings: Settings | None = None, sources: dict[str, Source] | None = None) -> Starlette:
    """Build the gateway. With no upstream URL configured, it starts the built-in
    simulator on a free loopback port and sends upstream traffic there."""
    if settings is None:
        settings, sources = load_settings()
    db = open_database(settings.database_url, settings.data_dir)
    saved = SavedSettings(db)
    live = LiveSettings(settings, sources or {}, saved)
    upstream = UpstreamClient()
    observability = Observability(live, db)
    relay = GenerationService(live, upstream, observability.observer)
    credential_state = CredentialState(db)
    # several processes on one store (PostgreSQL replicas, --workers): shared cap and health
    replication = Replication(db, settings.replica_id, lambda: relay.in_flight) if db.shared or settings.workers > 1 else None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        simulator = None
        simulator_url = None
        if not settings.upstream_url and not settings.config:
            from gateway.upstream.simulator import create_simulator_app

            sock = bind_loopback()
            simulator = await start_embedded(create_simulator_app(), sock)
            simulator_url = app.state.simulator_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        relay.pool = build_pool(settings, credential_state, simulator_url)
        if replication is not None:
            await replication.start(relay.pool)
            relay.capacity = replication.capacity
        if settings.capture_dir:
            relay.capture = CaptureWriter(settings.capture_dir, settings.capture_max_bytes)
        await observability.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await upstream.aclose()
            if relay.capture is not None:
                relay.capture.close()  # drains: every finished call is on disk
            await observability.aclose()  # drains the audit queue
            if replication is not None:
                await replication.aclose()
            saved.close()
            db.close()
            if simulator is not None:
                await stop_embedded(*simulator)

    def generation(room: ProtocolRoom):  # type: ignore[no-untyped-def]
        return generation_endpoint(relay, room)

    async def healthz(request: Request) -> Response:
        if getattr(request.app.state, "ready", False):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "starting"}, status_code=503)

    response_store = ResponseStore(db)
    responses_room = ResponsesRoom(response_store)
    routes = [
        Route("/v1/chat/completions", generation(ChatRoom()), methods=["POST"]),
        Route("/v1/responses", generation(responses_room), methods=["POST"]),
        Route("/v1/responses/{response_id}", keyed(retrieve_response_endpoint(response_store), openai_error), methods=["GET"]),
        Route("/v1/messages", generation(MessagesRoom()), methods=["POST"]),
        Route("/v1/messages/count_tokens", keyed(count_tokens_endpoint, anthropic_error), methods=["POST"]),
        Route("/v1/models", keyed(list_models, openai_error), methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *auth_routes(),
        admin_mount(),
        *webui_routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.live = live
    app.state.db = db
    app.state.relay = relay
    app.state.credential_state = credential_state
    app.state.replication = replication
    app.state.observability = observability
    app.state.ready = False
    return app
