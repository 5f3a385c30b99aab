"""``codebuddy2api serve|simulate|doctor``: flags -> settings -> a running server.

Every ``serve`` flag is also an environment variable (``--stream-mode`` ->
``CODEBUDDY2API_STREAM_MODE``); a flag wins over the environment. An invalid value exits
with status 2 and one line naming the flag (or variable) and the allowed values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

from gateway.admin.auth import AdminAccess, is_loopback, login_base_url
from gateway.http.connections import server_options as connection_options
from gateway.settings import (
    CLI_FIELDS,
    ENV_PREFIX,
    Settings,
    SettingsError,
    StreamMode,
    load_settings,
)
from gateway.startup_checks import operator_mistake


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _help(name: str, text: str) -> str:
    """A serve flag's help: what it does, its default and its environment variable."""
    field = Settings.model_fields[name]
    default = field.get_default(call_default_factory=True)
    if isinstance(default, StrEnum):
        default = default.value
    shown = "none" if default in (None, [], {}) else str(default)
    return f"{text} [default: {shown}; env {ENV_PREFIX}{name.upper()}]".replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    from gateway import __version__

    parser = _OneLineParser(prog="codebuddy2api", description="LLM streaming gateway")
    parser.add_argument("--version", action="version", version=f"codebuddy2api {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    serve = commands.add_parser(
        "serve", help="run the gateway",
        description="Run the gateway. Every flag is also an environment variable (shown with its default); "
        "a flag wins over the environment, which wins over .env and saved settings.",
    )
    for name, text in CLI_FIELDS.items():
        help_text = _help(name, text)
        flag = "--" + name.replace("_", "-")
        if name == "stream_mode":
            serve.add_argument(flag, dest=name, choices=[m.value for m in StreamMode], help=help_text)
        elif name == "upstream_stream":
            serve.add_argument(flag, dest=name, choices=["auto", "always", "never"], help=help_text)
        elif name in ("capture_tokens", "token_in"):
            serve.add_argument(flag, dest=name, choices=["none", "vllm", "llamacpp"], help=help_text)
        elif name == "routing":
            serve.add_argument(flag, dest=name, choices=["cache-aware", "round-robin"], help=help_text)
        elif name == "engine_api":
            serve.add_argument(flag, dest=name, choices=["none", "vllm"], help=help_text)
        elif name == "log_level":
            serve.add_argument(flag, dest=name, choices=["debug", "info", "warning", "error"], help=help_text)
        elif name in ("upstream_url", "api_key", "public_url", "allow_upstream_host", "cors_allow_origin"):
            serve.add_argument(flag, dest=name, action="append", default=None, help=help_text)
        elif name in ("allow_open", "simulator", "serve_unrecorded", "capture_strict"):
            serve.add_argument(flag, dest=name, action="store_true", default=None, help=help_text)
        elif name == "audit_bodies":
            serve.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            serve.add_argument(flag, dest=name, help=help_text)
    capture = commands.add_parser("capture", help="model-call capture records")
    capture_commands = capture.add_subparsers(dest="capture_command", required=True, parser_class=_OneLineParser)
    export = capture_commands.add_parser("export", help="one rollout's records, in order, as JSONL")
    export.add_argument("--rollout", required=True, help="the rollout id (the x-rollout-id header)")
    export.add_argument("--capture-dir", help="read the JSONL capture files of this directory instead of the store")
    export.add_argument("--data-dir", default=None, help="the gateway's data directory (its SQLite store) [default: the settings']")
    export.add_argument("--database-url", default=None, help="the PostgreSQL URL the gateways share (instead of --data-dir)")
    export.add_argument("--store", action="store_true", help="read the store (the default; kept for older scripts)")
    saved = commands.add_parser("settings", help="inspect or change saved settings offline (gateway stopped or not)")
    saved_commands = saved.add_subparsers(dest="settings_command", required=True, parser_class=_OneLineParser)
    for name, help_text in (("show", "print the saved values (secrets redacted) and the revision"),
                            ("unset", "remove a saved value (e.g. a leaked client key), bump the revision, check integrity")):
        sub = saved_commands.add_parser(name, help=help_text)
        if name == "unset":
            sub.add_argument("key", help="the setting's name, e.g. api_key")
        sub.add_argument("--data-dir", default=None, help="the gateway's data directory")
        sub.add_argument("--database-url", default=None, help="the PostgreSQL URL the gateways share (instead of --data-dir)")
    simulate = commands.add_parser("simulate", help="run the built-in upstream simulator")
    simulate.add_argument("--host", default="127.0.0.1", help="address to bind [default: %(default)s]")
    simulate.add_argument("--port", type=int, default=9090, help="port to bind [default: %(default)s]")
    doctor = commands.add_parser(
        "doctor", help="probe an upstream the way the gateway will use it and report its quirks",
    )
    doctor.add_argument("url", help="the upstream's base URL, e.g. http://127.0.0.1:8000/v1")
    doctor.add_argument("--api-key", default=None, help="upstream API key [env CODEBUDDY2API_UPSTREAM_API_KEY]")
    doctor.add_argument("--model", default=None, help="model to probe [default: the first the upstream lists]")
    doctor.add_argument("--timeout", type=float, default=60.0, help="seconds per probe [default: %(default)s]")
    doctor.add_argument("--tool-choice", choices=["auto", "required"], default="auto",
                        help="tool_choice of the tool-call probe (small models may need required) [default: %(default)s]")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "settings":
        return saved_settings_command(args)
    if args.command == "capture":
        from gateway.rollout.export_cli import export_capture

        return export_capture(args.rollout, args.capture_dir, args.data_dir, args.database_url)
    if args.command == "simulate":
        from gateway.simulator.server import run_simulator

        return _run_or_refuse(lambda: run_simulator(args.host, args.port, announce=True), args.host, args.port)
    if args.command == "doctor":
        from gateway.doctor import doctor_command

        return doctor_command(args)
    cli_values = {name: getattr(args, name) for name in CLI_FIELDS}
    try:
        settings, sources = load_settings(cli_values)
        problem = operator_mistake(settings, sources, os.environ)
        if problem:
            raise SettingsError(problem)
        check_startup(settings)
    except SettingsError as exc:
        print(f"codebuddy2api: error: {exc}", file=sys.stderr)
        return 2
    return _run_or_refuse(lambda: serve(settings, sources, cli_values), settings.host, settings.port)


def check_startup(settings: Settings) -> None:
    """Refuse, with one line, a start-up that would serve the wrong thing: an open
    non-loopback bind, keys for no upstream, or the simulator answering in production."""
    from gateway.upstream.config_file import load_config_file
    from gateway.upstream.urls import check_upstream_url

    loopback = is_loopback(settings.host)
    if not settings.api_key and not settings.allow_open and not loopback:
        raise SettingsError(
            f"--host {settings.host} is not a loopback address and no client "
            "--api-key is configured; add --api-key KEY or --allow-open"
        )
    entries = load_config_file(settings.config).upstreams if settings.config else []
    for n, entry in enumerate(entries):  # the host rule needs --allow-upstream-host: checked here
        try:
            check_upstream_url(entry.base_url, settings.allow_upstream_host)
        except ValueError as exc:
            raise SettingsError(f"--config {settings.config}: upstreams[{n}].base_url: {exc}") from None
    if settings.config:  # an unset api_key_env would silently leave the upstream a key short
        from gateway.upstream.config import unset_key_variable

        problem = unset_key_variable(settings.config, entries, os.environ)
        if problem:
            raise SettingsError(problem)
    config_upstreams = len(entries)
    if settings.config and not config_upstreams:
        raise SettingsError(f"--config {settings.config}: no [[upstreams]] table (see docs/configuration.md)")
    configured = bool(settings.upstream_url) or config_upstreams > 0
    if settings.simulator and configured:
        raise SettingsError("--simulator and --upstream-url/--config exclude each other; pick one")
    if (settings.upstream_api_key or settings.upstream_api_key_file) and not settings.upstream_url:
        raise SettingsError(
            "--upstream-api-key/--upstream-api-key-file given without --upstream-url "
            "(keys of a --config upstream go in its [[upstreams]] table)"
        )
    if not configured and not settings.simulator and not loopback and not _added_credentials(settings):
        raise SettingsError(
            f"no upstream configured and --host {settings.host} is not loopback: add --upstream-url URL "
            "(or --config FILE); --simulator serves scripted answers, for demos only"
        )


def _added_credentials(settings: Settings) -> int:
    """How many upstream credentials were added through the admin API (kept in the store);
    0 when there is no store yet or it cannot be read (serving reports that itself)."""
    from gateway.store.credentials import CredentialState
    from gateway.store.db import SQLITE_FILENAME, open_database

    if settings.database_url is None and not (settings.data_dir / SQLITE_FILENAME).exists():
        return 0
    try:
        db = open_database(settings.database_url, settings.data_dir)
    except Exception:  # noqa: BLE001  (an unreachable server or a bad file: not this check's to report)
        return 0
    try:
        return len(CredentialState(db).added_credentials())
    finally:
        db.close()


def _run_or_refuse(run: Any, host: str, port: int) -> int:
    """Run a server after checking its address is free: "address in use" is one line
    and exit status 2, not a page of uvicorn log lines."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                reason = "the address is already in use (another gateway running? pick another --port)"
            else:
                reason = exc.strerror or str(exc)
            print(f"codebuddy2api: error: cannot listen on {host}:{port}: {reason}", file=sys.stderr)
            return 2
    status = run()
    return status if isinstance(status, int) else 0


def saved_settings_command(args: argparse.Namespace) -> int:
    """Offline maintenance of the saved layer, through the same transactional writer the
    admin API uses (so running gateways pick the new revision up on their next request)."""
    from pathlib import Path

    from gateway.store.db import SQLITE_FILENAME, open_database
    from gateway.store.saved_settings import SavedSettings, redact

    configured = load_settings()[0] if not (args.data_dir or args.database_url) else None
    data_dir = Path(args.data_dir) if args.data_dir else (configured.data_dir if configured else Path("data"))
    database_url = args.database_url or (configured.database_url if configured else None)
    if not database_url and not (data_dir / SQLITE_FILENAME).exists():
        print(f"codebuddy2api: error: no store at {data_dir / SQLITE_FILENAME}", file=sys.stderr)
        return 2
    try:
        db = open_database(database_url, data_dir)
    except Exception as exc:  # a bad URL or an unreachable server: one line, no secret
        print(f"codebuddy2api: error: cannot open the database: {type(exc).__name__}", file=sys.stderr)
        return 2
    saved = SavedSettings(db)
    try:
        revision, values = saved.load()
        if args.settings_command == "show":
            print(json.dumps({"revision": revision, "saved": {k: redact(k, v) for k, v in values.items()}}, indent=2))
            return 0
        if args.key not in values:
            print(f"codebuddy2api: error: {args.key} has no saved value (revision {revision})", file=sys.stderr)
            return 2
        new = saved.write(revision, {}, [args.key], actor="cli-offline")
        check = saved.integrity_check()
        print(json.dumps({"removed": args.key, "revision": new, "integrity_check": check}))
        return 0 if check == "ok" else 1
    finally:
        saved.close()
        db.close()


def unusable_directory(path: Path, flag: str) -> str | None:
    """Why ``path`` cannot hold the gateway's state (one line naming the flag), or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".codebuddy2api-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        return f"{path} is not a writable directory ({flag}): {exc.strerror or type(exc).__name__}"
    return None


def serve(settings: Settings, sources: dict, cli_values: dict[str, Any] | None = None) -> int:  # type: ignore[type-arg]
    """Run uvicorn: the app object in-process, or ``--workers N`` processes that each build
    the app from :func:`worker_app` (uvicorn needs an import string to spawn workers).
    A data dir (or spill dir) that cannot be written is one line and exit code 2."""
    import sqlite3

    import uvicorn

    from gateway.observability.logging import configure_logging

    configure_logging(settings.log_level)
    directories = [(settings.data_dir, "--data-dir")]
    if settings.spill_dir is not None:
        directories.append((settings.spill_dir, "--spill-dir"))
    for path, flag in directories:
        problem = unusable_directory(path, flag)
        if problem:
            print(f"codebuddy2api: error: {problem}", file=sys.stderr)
            return 2
    problem = wait_for_postgres(settings)
    if problem:
        print(f"codebuddy2api: error: {problem}", file=sys.stderr)
        return EXIT_TEMPFAIL
    common: dict[str, Any] = dict(
        host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None, access_log=True,
        timeout_graceful_shutdown=settings.shutdown_timeout + SHUTDOWN_GRACE,
    )
    common.update(websocket_options(settings))
    common.update(connection_options(settings))  # --header-timeout, --max-connections-per-ip
    access = AdminAccess.from_settings(settings.admin_token)  # one token for every worker
    try:
        if settings.workers > 1:
            prepare_workers(settings, cli_values or {}, access)
            _banner_before_workers(settings, sources, admin_login_url(settings, access))
            return run_workers(settings, common)
        from gateway.app import create_app

        app = create_app(settings, sources, admin_login_token=access.token if access.generated else None)
        app.state.print_banner = True  # printed by the lifespan once the upstreams are known
    except postgres_errors() as exc:  # PostgreSQL went away again after the wait
        from gateway.store.wait import describe

        print(f"codebuddy2api: error: cannot open the database: {describe(exc, settings)}", file=sys.stderr)
        return EXIT_TEMPFAIL
    except (OSError, sqlite3.Error) as exc:  # the store or the spill journal cannot be opened
        where = settings.spill_dir if isinstance(exc, OSError) and settings.spill_dir else settings.data_dir
        print(f"codebuddy2api: error: cannot open the gateway's state in {where}: "
              f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, **common)
    return 0


def wait_for_postgres(settings: Settings) -> str | None:
    """With a PostgreSQL URL: wait up to ``--database-wait`` for it (gateway.store.wait);
    the one line to exit :data:`EXIT_TEMPFAIL` with when it never came, else None."""
    from gateway.store.db import is_postgres_url

    url = settings.database_url.get_secret_value() if settings.database_url is not None else ""
    if not is_postgres_url(url):
        return None
    from gateway.store.wait import DatabaseUnreachable, wait_for_database

    try:
        wait_for_database(url, settings.database_wait)
    except DatabaseUnreachable as exc:
        return f"{exc} (--database-wait {settings.database_wait:g})"
    return None


def postgres_errors() -> tuple[type[BaseException], ...]:
    """psycopg's base error when it is installed (a database that went away again)."""
    try:
        import psycopg
    except ImportError:  # pragma: no cover
        return ()
    return (psycopg.Error,)


def run_workers(settings: Settings, common: dict[str, Any]) -> int:
    """``--workers N`` under :class:`gateway.http.workers.WorkerSupervisor`: 0 after a normal
    stop, 1 (with one line) when a worker's replacement kept failing to start."""
    import uvicorn

    from gateway.http.workers import WorkerSupervisor

    config = uvicorn.Config(WORKER_APP, factory=True, workers=settings.workers, **common)
    supervisor = WorkerSupervisor(config, [config.bind_socket()], settings.worker_restart_attempts)
    supervisor.run()
    if supervisor.gave_up:
        print(f"codebuddy2api: error: {supervisor.gave_up} (--worker-restart-attempts"
              f" {settings.worker_restart_attempts})", file=sys.stderr)
        return 1
    return 0


#: The exit status of a start-up that found PostgreSQL unreachable (past ``--database-wait``):
#: sysexits' EX_TEMPFAIL, "try again later". Not 2, a refused configuration that retrying
#: cannot fix: systemd's ``RestartPreventExitStatus=2`` must not keep a gateway down once
#: its database comes back (issue #40).
EXIT_TEMPFAIL = 75

#: Seconds past ``--shutdown-timeout`` uvicorn waits for the cut streams to say goodbye.
SHUTDOWN_GRACE = 5.0

#: Bytes past ``--max-body-bytes`` in which a WebSocket frame still reaches the app, so the
#: client gets the wrapped 413 (gateway.protocols.responses.websocket) rather than a bare close.
WS_FRAME_SLACK = 1024 * 1024


def websocket_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's WebSocket limit: a frame over ``--max-body-bytes`` + :data:`WS_FRAME_SLACK`
    is refused by the server (close 1009) from its header, before its payload is buffered
    (uvicorn's default, 16 MiB, would refuse frames the HTTP route accepts); and its
    protocol, drained on a stop signal."""
    from gateway.http.shutdown import DRAINING_WEBSOCKETS

    # ws: uvicorn's protocol, drained on SIGTERM like HTTP streams (gateway/http/shutdown.py)
    return {"ws_max_size": settings.max_body_bytes + WS_FRAME_SLACK, "ws": DRAINING_WEBSOCKETS}


def admin_login_url(settings: Settings, access: AdminAccess) -> str | None:
    """The generated admin token's login URL (None with a configured ``--admin-token``):
    written to a 0600 file in the data dir and shown whole on a terminal only; it is never
    logged (the log pipeline masks every secret, this one included)."""
    return access.login_url(login_base_url(settings.host, settings.port, settings.public_url))


def _banner_before_workers(settings: Settings, sources: dict, login_url: str | None) -> None:  # type: ignore[type-arg]
    """With ``--workers N`` the parent says it once (each worker builds its own app),
    with the saved values the workers will apply."""
    from gateway.app import WEBUI_DIR, uses_simulator
    from gateway.banner import announce
    from gateway.keys import store as key_store
    from gateway.live_settings import LiveSettings
    from gateway.store.credentials import CredentialState
    from gateway.store.db import open_database
    from gateway.store.saved_settings import SavedSettings
    from gateway.upstream.config import build_pool

    db = open_database(settings.database_url, settings.data_dir)
    saved = SavedSettings(db)
    try:
        live = LiveSettings(settings, sources, saved)
        current, current_sources = live.current, live.sources
        state = CredentialState(db)
        simulator = "http://127.0.0.1/v1 (one per worker)" if uses_simulator(settings, len(state.added_credentials())) else None
        upstreams = [c.upstream for c in build_pool(settings, state, simulator).credentials]
        managed_keys = key_store.load_all(db)
    finally:
        saved.close()
        db.close()
    announce(current, upstreams, simulator, (WEBUI_DIR / "index.html").is_file(), login_url, current_sources, settings.data_dir,
             managed_keys=managed_keys)


#: The environment variable carrying the resolved CLI values to worker processes (JSON).
CLI_VALUES_ENV = "CODEBUDDY2API_WORKER_CLI_VALUES"
#: ... and the admin token generated for this run (so a session works on every worker).
ADMIN_LOGIN_TOKEN_ENV = "CODEBUDDY2API_WORKER_ADMIN_LOGIN_TOKEN"
WORKER_APP = "gateway.cli:worker_app"


def prepare_workers(settings: Settings, cli_values: dict[str, Any], access: AdminAccess | None = None) -> None:
    """Before workers spawn: a fresh prometheus multiprocess dir, the CLI values for
    :func:`worker_app`, and the database migrated once (workers must not race on it)."""
    from gateway.store.db import open_database

    metrics_dir = settings.data_dir / "prometheus-multiproc"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir.resolve())
    os.environ[CLI_VALUES_ENV] = json.dumps({k: v for k, v in cli_values.items() if v is not None})
    if access is not None and access.generated:
        os.environ[ADMIN_LOGIN_TOKEN_ENV] = access.token
    open_database(settings.database_url, settings.data_dir).close()


def worker_app() -> Any:
    """App factory run in each worker: the same settings, with the same sources, as the CLI
    resolved (CLI values from :data:`CLI_VALUES_ENV`; env and ``.env`` are inherited)."""
    from gateway.app import create_app
    from gateway.observability.logging import configure_logging

    cli_values = json.loads(os.environ.get(CLI_VALUES_ENV) or "{}")
    settings, sources = load_settings(cli_values)
    configure_logging(settings.log_level)
    connection_options(settings)  # this worker's connection limits
    return create_app(settings, sources, admin_login_token=os.environ.get(ADMIN_LOGIN_TOKEN_ENV))


if __name__ == "__main__":
    sys.exit(main())
