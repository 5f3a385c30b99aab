"""The Starlette application: routes, and the lifespan that owns every long-lived part."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from importlib import resources
from pathlib import Path

import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.admin import admin_mount, auth_routes
from gateway.admin.auth import AdminAccess, login_base_url
from gateway.admin.common import admin_error
from gateway.admin.reload_api import reload_on_signal
from gateway.admin.sessions import SessionEpoch
from gateway.admin.throttle import AttemptThrottle
from gateway.engines.control import EngineControl
from gateway.engines.fleet import EngineFleet
from gateway.engines.hold import EngineHold
from gateway.engines.load import EngineLoadPoller
from gateway.errors import GatewayError
from gateway.generation.passthrough import CompletionsRoute, EmbeddingsRoute
from gateway.generation.recording_gate import RecordingGate, with_spill_hint
from gateway.generation.service import ATTEMPTS_SCOPE_KEY, GenerationService
from gateway.http.admin_surface import AdminSurface
from gateway.http.body_limit import BodyLimit
from gateway.http.cross_site import CrossSiteGuard
from gateway.http.listeners import take_and_serve_queued
from gateway.http.servers import (
    before_listeners_close,
    bind_loopback,
    on_hangup,
    on_server_exit,
    start_embedded,
    stop_embedded,
)
from gateway.http.shutdown import GracefulShutdown
from gateway.keys import store as key_store
from gateway.keys.budget_left import BudgetLeft
from gateway.keys.limiter import KeyLimiter
from gateway.keys.model import ManagedKey
from gateway.keys.registry import KeyRegistry
from gateway.live_settings import LiveSettings
from gateway.observability.loop_lag import LoopLagMonitor, publish_samples
from gateway.observability.observer import Observability, metrics_endpoint
from gateway.observability.state_gauges import StateSources
from gateway.protocols.base import ProtocolRoom
from gateway.protocols.chat import ChatRoom
from gateway.protocols.messages.room import MessagesRoom
from gateway.protocols.messages.room import error_json as anthropic_error
from gateway.protocols.openai_shapes import error_json as openai_error
from gateway.protocols.responses.room import ResponsesRoom
from gateway.protocols.responses.websocket import websocket_endpoint as responses_websocket
from gateway.protocols.responses.websocket_slots import ConnectionSlots
from gateway.redact import SECRETS, RedactingSend
from gateway.rollout import labels as rollout_labels
from gateway.rollout import store as rollout_store
from gateway.rollout.capture_files import CaptureWriter
from gateway.rollout.ids import RolloutPaths
from gateway.rollout.recorder import RolloutRecorder
from gateway.routes.generation import (
    count_tokens_endpoint,
    generation_endpoint,
    retrieve_response_endpoint,
)
from gateway.routes.models import keyed, list_models, retrieve_model, route_error_handlers
from gateway.routes.readiness import readyz
from gateway.settings import Settings, Source, load_settings
from gateway.store.credentials import CredentialState, CredentialStateWriter
from gateway.store.db import open_database
from gateway.store.envelope_keys import EnvelopeKeys
from gateway.store.replicas import Replication
from gateway.store.responses import ResponseStore
from gateway.store.saved_settings import SavedSettings
from gateway.store.spill import SpillJournal
from gateway.upstream.client import UpstreamClient
from gateway.upstream.config import build_pool
from gateway.upstream.credential import Credential
from gateway.upstream.prober import CredentialProber
from gateway.upstream.urls import header_secrets, url_secrets

log = structlog.get_logger("gateway")

#: The response header naming a built-in simulator upstream (clients can tell fiction apart).
UPSTREAM_HEADER = "x-codebuddy2api-upstream"


def _webui_dir() -> Path:
    """The WebUI's static files (plain HTML/CSS/JS, no build step): inside the installed
    package (``gateway/webui``, copied there by the wheel build, see setup.py), else the
    source tree's ``webui/`` beside the package (checkouts and editable installs)."""
    packaged = Path(str(resources.files("gateway"))) / "webui"
    if (packaged / "index.html").is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "webui"


WEBUI_DIR = _webui_dir()


def webui_routes() -> list[BaseRoute]:
    """``/ui/`` serves the WebUI and ``/`` redirects there (absent from a wheel without it)."""
    if not (WEBUI_DIR / "index.html").is_file():
        return []

    async def home(request: Request) -> Response:
        return RedirectResponse("/ui/", status_code=307)

    return [Route("/", home, methods=["GET"]), Mount("/ui", app=StaticFiles(directory=WEBUI_DIR, html=True))]


def uses_simulator(settings: Settings, added_credentials: int = 0) -> bool:
    """``--simulator``, or nothing else configured: no flag, no ``--config``, no credential
    added through the admin API (the CLI allows that on loopback only)."""
    return settings.simulator or (not settings.upstream_url and not settings.config and not added_credentials)


def answering_upstream(scope: Scope) -> str:
    """The upstream a generation answer comes from: the attempt that answered 200, else the
    one under way when the status line goes (a keepalive may commit it first); ``simulator``
    when none was made (a refusal, a non-generation route)."""
    attempts = scope.get(ATTEMPTS_SCOPE_KEY)
    log = getattr(attempts, "log", None) or []
    answered = [a for a in log if a.get("status") == 200]
    chosen = (answered or log)[-1:] if log else []
    return str(chosen[0]["upstream"]) if chosen else "simulator"


class SimulatorHeader:
    """Marks every response with ``x-codebuddy2api-upstream`` while the built-in simulator
    is in the pool, so no client mistakes its answers for a model's: ``simulator``, or the
    name of the real upstream (added at run time) that answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                name = answering_upstream(scope).encode("latin-1", "replace")
                message = {**message, "headers": [*message.get("headers", []), (UPSTREAM_HEADER.encode(), name)]}
            await send(message)

        await self.app(scope, receive, send_marked)


def error_for_path(path: str, err: GatewayError) -> Response:
    """An error in the shape of the route it answers (for layers in front of the routes)."""
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error(err), status_code=err.status)
    if path.startswith("/v1/"):
        return JSONResponse(openai_error(err), status_code=err.status)
    return admin_error(err.status, err.code, err.message)


def settings_secrets(settings: Settings) -> list[str]:
    """Every secret a settings object holds, for :data:`gateway.redact.SECRETS`."""
    from urllib.parse import urlsplit

    out = [key.get_secret_value() for key in settings.api_key]
    if settings.upstream_api_key is not None:
        out += [k.strip() for k in settings.upstream_api_key.get_secret_value().split(",")]
    if settings.admin_token is not None:
        out.append(settings.admin_token.get_secret_value())
    if settings.database_url is not None:
        url = settings.database_url.get_secret_value()
        out += [url, urlsplit(url).password or ""]
    for url in settings.upstream_url:
        out += url_secrets(url)
    return out


def pool_secrets(credentials: Iterable[Credential]) -> list[str]:
    """Every secret the pool holds: keys, configured header values, URL userinfo."""
    out: list[str] = []
    for upstream in {id(c.upstream): c.upstream for c in credentials}.values():
        out += header_secrets(upstream.headers) + url_secrets(upstream.base_url)
    return out + [c.api_key for c in credentials if c.api_key]


def create_app(
    settings: Settings | None = None, sources: dict[str, Source] | None = None, admin_login_token: str | None = None
) -> Starlette:
    """Build the gateway. With ``--simulator`` (or no upstream configured), it starts the
    built-in simulator on a free loopback port and sends upstream traffic there. Without an
    ``--admin-token``, the admin token is ``admin_login_token`` (the CLI's, shared by its
    workers) or one generated here; ``app.state.admin_login_url`` is its login URL."""
    if settings is None:
        settings, sources = load_settings()
    db = open_database(settings.database_url, settings.data_dir)
    saved = SavedSettings(db)
    live = LiveSettings(settings, sources or {}, saved)
    upstream = UpstreamClient(max_connections=settings.upstream_max_connections)
    journal = SpillJournal(settings.spill_dir or settings.data_dir / "spill", settings.spill_max_bytes)
    observability = Observability(live, db, journal=journal)
    relay = GenerationService(live, upstream, observability.observer)
    relay.recording = RecordingGate(  # refuse, rather than serve unrecorded (unless --serve-unrecorded)
        observability.durable.unrecordable, lambda: live.current.serve_unrecorded,
        lambda action: observability.metrics.unrecordable_requests.labels(action).inc(),
    )
    observability.durable.statements.update(rollout_store.STATEMENTS)  # replayed like the audit
    observability.durable.statements.update(rollout_labels.STATEMENTS)
    relay.rollouts = RolloutRecorder(db, observability.durable, live, lambda: relay.pool)
    metrics = observability.metrics
    engine_control = EngineControl()  # its HTTP client opens with the lifespan
    engines = relay.engines = EngineFleet(
        lambda: relay.pool, engine_control, EngineHold(on_held=metrics.engine_held_calls.set),
        lambda name, paused: metrics.engine_paused.labels(name).set(1 if paused else 0),
    )
    engines.on_continued = metrics.continuations.labels("abort").inc
    envelope_keys = EnvelopeKeys(db)
    envelope_keys.load()  # before serving: requests only read the in-memory keyring
    relay.envelope_keys = envelope_keys
    client_keys = relay.keys = KeyRegistry(db)
    budget_left = BudgetLeft(observability.metrics.key_budget_left, db)  # codebuddy2api_key_budget_left

    def keys_loaded(keys: list[ManagedKey]) -> None:
        observability.metrics.declare_keys(keys)
        budget_left.reloaded(keys)

    client_keys.on_load = keys_loaded
    client_keys.load()  # before serving: requests authenticate against the in-memory keys
    observability.durable.statements.update(key_store.statements(db))  # settlements, journaled too
    relay.limiter = KeyLimiter(db, observability.durable, price=observability.observer.price)  # money budgets
    relay.limiter.on_settled = budget_left.settled
    credential_state = CredentialState(db)
    # several processes on one store (PostgreSQL replicas, --workers): shared cap and health
    replication = Replication(db, settings.replica_id, lambda: relay.in_flight) if db.shared or settings.workers > 1 else None
    simulated = uses_simulator(settings, len(credential_state.added_credentials()))
    access = AdminAccess.from_settings(settings.admin_token, admin_login_token)
    owner = f"app-{id(live)}"  # this app's share of the process-wide secret set
    SECRETS.set(owner + ":admin", [access.token, access.signing_key.hex()])
    live.listeners.append(lambda current: SECRETS.set(owner + ":settings", settings_secrets(current)))
    SECRETS.set(owner + ":settings", settings_secrets(live.current))

    def track_pool() -> None:
        SECRETS.set(owner + ":pool", pool_secrets(relay.pool.credentials))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        simulator = None
        simulator_url = None
        if simulated:
            from gateway.simulator.server import create_simulator_app

            sock = bind_loopback()
            simulator = await start_embedded(create_simulator_app(), sock, label="simulator")
            simulator_url = app.state.simulator_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        relay.pool = build_pool(settings, credential_state, simulator_url)
        for credential_id in relay.pool.superseded:  # the config holds their keys now: one credential each
            await asyncio.to_thread(credential_state.forget_added, credential_id)
        relay.pool.on_change = track_pool
        relay.pool.on_lease = observability.metrics.lease_changed  # calls in flight per replica
        track_pool()
        state_writer = relay.pool.state.writer = CredentialStateWriter(credential_state, on_saved=relay.pool.state.saved)
        await state_writer.start()
        prober = CredentialProber(lambda: relay.pool, upstream, settings.credential_probe_interval)
        await prober.start()
        observability.metrics.declare_configuration(relay.pool)
        engine_control.open()
        await engines.learn_versions()  # each engine's version before the first call (2 s bound per engine)
        engine_load = EngineLoadPoller(lambda: relay.pool, engine_control)  # vLLM's own queue, for the router
        await engine_load.start()
        if getattr(app.state, "print_banner", False):
            from gateway.banner import announce

            upstreams = [c.upstream for c in relay.pool.credentials]
            login_url = getattr(app.state, "admin_login_url", None)
            announce(live.current, upstreams, simulator_url, bool(webui), login_url, live.sources, settings.data_dir,
                     lambda facts: with_spill_hint(facts, journal, live.current.serve_unrecorded), client_keys.keys())
        if replication is not None:
            await replication.start(relay.pool)
            relay.capacity = replication.capacity
        observability.metrics.state.sources = StateSources(  # read at each scrape
            lambda: relay.pool.credentials,
            lambda: len(replication.capacity.live) if replication is not None else 1,
            lambda: (relay.capacity.limit(live.current.max_concurrent) if relay.capacity is not None
                     else live.current.max_concurrent),
        )
        if settings.capture_dir:
            captured = observability.metrics.capture_records
            relay.capture = CaptureWriter(
                settings.capture_dir, settings.capture_max_bytes,
                on_written=captured.labels("written").inc, on_dropped=captured.labels("dropped").inc,
                on_lost=captured.labels("lost").inc,
            )
        await observability.start()
        loop_lag = app.state.loop_lag = LoopLagMonitor(
            settings.ready_max_loop_lag, publish_samples(observability.metrics, upstream)
        )
        await loop_lag.start()
        await envelope_keys.start()
        await client_keys.start()
        await relay.limiter.start()  # renews the leases of this process's reservations
        shutdown = app.state.shutdown = GracefulShutdown(
            settings.shutdown_timeout, relay.running.abort_all, lambda: relay.in_flight, observability.metrics.shutdown_cut.inc
        )

        def begin_shutdown() -> None:
            app.state.shutting_down = True  # /readyz: 503 from now on
            shutdown.begin()

        on_server_exit(begin_shutdown)
        before_listeners_close(take_and_serve_queued)  # the listen backlog is answered, not reset
        reloads: set[asyncio.Task[None]] = set()

        def hangup() -> None:  # SIGHUP: re-read --config (gateway/admin/reload_api.py)
            task = asyncio.get_running_loop().create_task(reload_on_signal(app))
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        stop_hangups = on_hangup(hangup)
        app.state.ready = True
        try:
            yield
        finally:
            if stop_hangups is not None:
                stop_hangups()
            app.state.ready = False
            await shutdown.aclose()
            await loop_lag.stop()
            await prober.aclose()
            await envelope_keys.aclose()
            await client_keys.aclose()
            await upstream.aclose()
            await engines.aclose()
            await engine_load.aclose()
            await engine_control.aclose()
            if relay.capture is not None:
                relay.capture.close()  # drains: every finished call is on disk
            await relay.limiter.aclose()  # settlements under way, before the writer closes
            await budget_left.aclose()
            await relay.rollouts.aclose()  # failed calls' records, before the writer closes
            await observability.aclose()  # drains the audit queue
            await state_writer.aclose()
            if replication is not None:
                await replication.aclose()
            saved.close()
            db.close()
            if simulator is not None:
                await stop_embedded(*simulator)
            for share in ("admin", "settings", "pool", "retired"):
                SECRETS.drop(f"{owner}:{share}")

    def generation(room: ProtocolRoom):  # type: ignore[no-untyped-def]
        return generation_endpoint(relay, room)

    async def healthz(request: Request) -> Response:
        """Liveness: the process is up and its lifespan ran (``/readyz`` says whether it
        should take traffic)."""
        if getattr(request.app.state, "ready", False):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "starting"}, status_code=503)

    response_store = ResponseStore(db, observability.durable)  # spills like the audit
    responses_room = ResponsesRoom(response_store)
    webui = webui_routes()
    metrics = observability.metrics
    websocket_slots = ConnectionSlots(metrics.websockets_open.set, metrics.websocket_upgrades_refused.inc)
    routes = [
        Route("/v1/chat/completions", generation(ChatRoom()), methods=["POST"]),
        Route("/v1/responses", generation(responses_room), methods=["POST"]),
        WebSocketRoute("/v1/responses", responses_websocket(relay, responses_room, websocket_slots)),
        Route("/v1/responses/compact", generation(responses_room.compact_room()), methods=["POST"]),
        Route("/v1/responses/{response_id}", keyed(retrieve_response_endpoint(response_store), openai_error), methods=["GET"]),
        Route("/v1/messages", generation(MessagesRoom()), methods=["POST"]),
        Route("/v1/messages/count_tokens", keyed(count_tokens_endpoint, anthropic_error), methods=["POST"]),
        Route("/v1/completions", generation(CompletionsRoute()), methods=["POST"]),  # type: ignore[arg-type]
        Route("/v1/embeddings", generation(EmbeddingsRoute()), methods=["POST"]),  # type: ignore[arg-type]
        Route("/v1/models", keyed(list_models, openai_error), methods=["GET"]),
        Route("/v1/models/{model_id:path}", keyed(retrieve_model, openai_error), methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *auth_routes(),
        admin_mount(),
        *webui,
    ]
    middleware = [  # outermost first; all inside Starlette's error middleware
        Middleware(RolloutPaths),  # /rollouts/{id}/v1/... -> /v1/... with the id in the scope
        Middleware(RedactingSend),
        Middleware(CrossSiteGuard, live=live, public_urls=settings.public_url,
                   bind_host=settings.host, allow_origins=settings.cors_allow_origin,
                   managed_keys=lambda: client_keys.exists),
        Middleware(AdminSurface, public_urls=settings.public_url, bind_host=settings.host),
        Middleware(BodyLimit, limit=settings.max_body_bytes, render=error_for_path),
    ]
    if simulated:
        middleware.insert(0, Middleware(SimulatorHeader))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware, exception_handlers=route_error_handlers())
    app.state.admin_access = access
    app.state.admin_throttle = AttemptThrottle()  # failed token attempts (gateway.admin.throttle)
    app.state.admin_sessions = SessionEpoch(saved)  # logout revokes, on every process sharing the store
    app.state.admin_login_url = access.login_url(login_base_url(settings.host, settings.port, settings.public_url))
    app.state.live = live
    app.state.db = db
    app.state.envelope_keys = envelope_keys
    app.state.client_keys = client_keys
    app.state.secrets_owner = owner  # its shares of gateway.redact.SECRETS (a reload adds "retired")
    app.state.reload_lock = asyncio.Lock()  # one --config reload at a time (gateway/admin/reload_api.py)
    app.state.retired_keys = set()  # keys of credentials a reload took out: still masked
    app.state.relay = relay
    app.state.engines = engines
    app.state.credential_state = credential_state
    app.state.replication = replication
    app.state.observability = observability
    app.state.ready = False
    app.state.shutting_down = False
    return app
