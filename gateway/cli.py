"""``codebuddy2api serve|simulate``: flags -> settings -> a running server.

Every ``serve`` flag is also an environment variable (``--stream-mode`` ->
``CODEBUDDY2API_STREAM_MODE``); a flag wins over the environment. An invalid value exits
with status 2 and one line naming the flag (or variable) and the allowed values.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

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
        elif name == "log_level":
            serve.add_argument(flag, dest=name, choices=["debug", "info", "warning", "error"], help=help_text)
        else:
            serve.add_argument(flag, dest=name, help=help_text)
    simulate = commands.add_parser("simulate", help="run the built-in upstream simulator")
    simulate.add_argument("--host", default="127.0.0.1")
    simulate.add_argument("--port", type=int, default=9090)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    serve(settings, sources)
    return 0


def serve(settings: Settings, sources: dict) -> None:  # type: ignore[type-arg]
    import uvicorn

    from gateway.app import create_app
    from gateway.observability.logging import configure_logging

    configure_logging(settings.log_level)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(settings, sources)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


if __name__ == "__main__":
    sys.exit(main())
