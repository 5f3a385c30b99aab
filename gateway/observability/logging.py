"""structlog set-up: JSON lines for machines, pretty lines on a terminal, one pipeline.

structlog events and stdlib records (uvicorn's ``uvicorn.access`` / ``uvicorn.error``) both
end in the same :class:`structlog.stdlib.ProcessorFormatter` on one root handler, so an
operator sees one format. Levels are checked against the stdlib logger at call time (not
cached), so tests and operators can change them without reconfiguring structlog.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

from gateway.redact import redact_log_event

#: Keys whose values are never rendered, whoever logs them.
SECRET_KEYS = frozenset(
    {"authorization", "api_key", "upstream_api_key", "x-api-key", "admin_token", "password", "token", "secret"}
)
_HANDLER_NAME = "codebuddy2api"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
_state: dict[str, int] = {}  # the level configure_logging set, re-applied by route_uvicorn_logs


def redact_secrets(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Replace the value of any secret-named key, whatever it holds (configured or not)."""
    for key in list(event_dict):
        if key.lower() in SECRET_KEYS:
            event_dict[key] = "[redacted]"
    return event_dict


def uvicorn_access_fields(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Turn uvicorn's positional access-log record into fields (query strings dropped:
    they may carry tokens)."""
    args = event_dict.pop("positional_args", None)
    record = event_dict.get("_record")
    if record is not None and record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
        client, method, path, http_version, status = args
        event_dict["event"] = "http"
        event_dict["client"] = client
        event_dict["method"] = method
        event_dict["path"] = str(path).split("?", 1)[0]
        event_dict["http_version"] = http_version
        event_dict["status"] = status
    return event_dict


def _shared_processors() -> list[structlog.typing.Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
        redact_log_event,
    ]


def make_formatter(json: bool) -> structlog.stdlib.ProcessorFormatter:
    """The formatter every handler uses (JSON or console)."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    return structlog.stdlib.ProcessorFormatter(
        pass_foreign_args=True,
        foreign_pre_chain=[*_shared_processors(), uvicorn_access_fields],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redact_log_event,  # a traceback may quote a secret
            renderer,
        ],
    )


def configure_logging(level: str = "info", stream: TextIO | None = None, json: bool | None = None) -> None:
    """Route structlog and uvicorn's stdlib loggers through one handler on ``stream``.

    ``json`` defaults to JSON unless ``stream`` (stderr) is a terminal. Safe to call again
    (the handler is replaced, not added)."""
    out = stream if stream is not None else sys.stderr
    use_json = json if json is not None else not out.isatty()
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_shared_processors(),
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(out)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(make_formatter(use_json))
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if h.get_name() != _HANDLER_NAME]
    root.addHandler(handler)
    numeric = getattr(logging, level.upper())
    root.setLevel(numeric)
    _state["level"] = numeric
    route_uvicorn_logs()
    # one line per upstream call duplicates the request line; keep it for debugging
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))


def route_uvicorn_logs() -> None:
    """Send uvicorn's loggers to the root handler (again).

    Every ``uvicorn.Config`` built with ``access_log=False`` (the embedded simulator's, for
    one) detaches ``uvicorn.access`` and resets uvicorn's levels; the app's lifespan calls this after starting such
    servers. A no-op until :func:`configure_logging` installed the handler."""
    level = _state.get("level")
    if level is None or not any(h.get_name() == _HANDLER_NAME for h in logging.getLogger().handlers):
        return
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True
        logger.setLevel(level)
