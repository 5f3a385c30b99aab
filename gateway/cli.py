"""``codebuddy2api serve|simulate``: flags -> settings -> a running server.

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
from pathlib import Path
from typing import Any, NoReturn

from gateway.admin.auth import AdminAccess, is_loopback, login_base_url
from gateway.settings import CLI_FIELDS, Settings, SettingsError, StreamMode, load_settings


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="codebuddy2api", description="LLM streaming gateway")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    serve = commands.add_parser("serve", help="run the gateway")
    for name, help_text in CLI_FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if name == "stream_mode":
            serve.add_argument(flag, dest=name, choices=[m.value for m in StreamMode], help=help_text)
        elif name == "upstream_stream":
            serve.add_argument(flag, dest=name, choices=["auto", "always", "never"], help=help_text)
        elif name == "log_level":
            serve.add_argument(flag, dest=name, choices=["debug", "info", "warning", "error"], help=help_text)
        elif name in ("upstream_url", "api_key", "public_url"):
            serve.add_argument(flag, dest=name, action="append", default=None, help=help_text)
        elif name == "allow_open":
            serve.add_argument(flag, dest=name, action="store_true", default=None, help=help_text)
        elif name == "audit_bodies":
            serve.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            serve.add_argument(flag, dest=name, help=help_text)
    capture = commands.add_parser("capture", help="model-call capture records")
    capture_commands = capture.add_subparsers(dest="capture_command", required=True, parser_class=_OneLineParser)
    export = capture_commands.add_parser("export", help="one rollout's records, in order, as JSONL")
    export.add_argument("--rollout", required=True, help="the rollout id (the x-rollout-id header)")
    export.add_argument("--capture-dir", help="capture directory (default: CODEBUDDY2API_CAPTURE_DIR)")
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
    simulate.add_argument("--host", default="127.0.0.1")
    simulate.add_argument("--port", type=int, default=9090)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "settings":
        return saved_settings_command(args)
    if args.command == "capture":
        return export_capture(args.rollout, args.capture_dir)
    if args.command == "simulate":
        from gateway.upstream.simulator import run_simulator

        run_simulator(args.host, args.port)
        return 0
    cli_values = {name: getattr(args, name) for name in CLI_FIELDS}
    try:
        settings, sources = load_settings(cli_values)
    except SettingsError as exc:
        print(f"codebuddy2api: error: {exc}", file=sys.stderr)
        return 2
    if not settings.api_key and not settings.allow_open and not is_loopback(settings.host):
        print(
            f"codebuddy2api: error: --host {settings.host} is not a loopback address and no client "
            "--api-key is configured; add --api-key KEY or --allow-open",
            file=sys.stderr,
        )
        return 2
    return serve(settings, sources, cli_values)


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


def export_capture(rollout: str, capture_dir: str | None) -> int:
    import orjson

    from gateway.capture import export_rollout
    from pathlib import Path

    directory = capture_dir or load_settings()[0].capture_dir
    if not directory or not Path(directory).is_dir():
        print("codebuddy2api: error: --capture-dir names no capture directory", file=sys.stderr)
        return 2
    for record in export_rollout(Path(directory), rollout):
        sys.stdout.buffer.write(orjson.dumps(record) + b"\n")
    return 0


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
    common: dict[str, Any] = dict(
        host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None, access_log=True,
        timeout_graceful_shutdown=settings.shutdown_timeout + SHUTDOWN_GRACE,
    )
    access = AdminAccess.from_settings(settings.admin_token)  # one token for every worker
    try:
        if settings.workers > 1:
            prepare_workers(settings, cli_values or {}, access)
            announce_admin_login(settings, access)
            uvicorn.run(WORKER_APP, factory=True, workers=settings.workers, **common)
            return 0
        from gateway.app import create_app

        app = create_app(settings, sources, admin_login_token=access.token if access.generated else None)
    except (OSError, sqlite3.Error) as exc:  # the store or the spill journal cannot be opened
        where = settings.spill_dir if isinstance(exc, OSError) and settings.spill_dir else settings.data_dir
        print(f"codebuddy2api: error: cannot open the gateway's state in {where}: "
              f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    announce_admin_login(settings, access)
    uvicorn.run(app, **common)
    return 0


#: Seconds past ``--shutdown-timeout`` uvicorn waits for the cut streams to say goodbye.
SHUTDOWN_GRACE = 5.0


def announce_admin_login(settings: Settings, access: AdminAccess) -> None:
    """The generated admin token's login URL, once, on stderr: printed, not logged (the log
    pipeline masks every secret, this one included)."""
    url = access.login_url(login_base_url(settings.host, settings.port, settings.public_url))
    if url is not None:
        print(f"codebuddy2api: admin console (token for this run only; no --admin-token set): {url}",
              file=sys.stderr, flush=True)


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
    return create_app(settings, sources, admin_login_token=os.environ.get(ADMIN_LOGIN_TOKEN_ENV))


if __name__ == "__main__":
    sys.exit(main())
