"""The start-up banner: what this gateway is about to serve, said once, whatever the log
level — plain text on a terminal, one structured ``startup`` event otherwise.

:func:`startup_facts` is pure (settings and upstreams in, a JSON-able dict out), so tests
check the contents without starting a server; :func:`print_banner` only renders it.

The generated admin token's login URL is a credential: it never goes into the facts (what
log shippers keep from stderr), only a short prefix of the token and the path of the 0600
file :func:`write_login_file` put it in; the full URL is printed on a terminal only.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import orjson

from gateway import __version__
from gateway.admin.auth import is_loopback
from gateway.keys.model import ManagedKey
from gateway.keys.posture import ClientAuth
from gateway.rollout.facts import capture_facts
from gateway.settings import Settings, base_url_hint
from gateway.upstream.credential import Upstream

SIMULATOR = "SIMULATOR"


def listen_url(settings: Settings) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"


def _store(settings: Settings) -> str:
    if settings.database_url is None:
        from gateway.store.db import SQLITE_FILENAME

        return f"SQLite {settings.data_dir / SQLITE_FILENAME}"
    parts = urlsplit(settings.database_url.get_secret_value())
    if parts.scheme.startswith("sqlite"):
        return f"SQLite {parts.path}"
    # user, password and query stay out: only where the data lives
    return f"PostgreSQL {parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"


def client_auth(settings: Settings, managed_keys: Iterable[ManagedKey] = ()) -> ClientAuth:
    """Who may call /v1: the static keys, and the managed keys (any ever created locks
    /v1, loopback included)."""
    return ClientAuth.of(len(settings.api_key or ()), managed_keys, settings.allow_open, time.time())


def _capture_row(capture: dict[str, Any]) -> str:
    sources = capture["token_sources"]
    tokens = ", ".join(f"{name} {source}" for name, source in sources.items()) if sources else "none (no token ids)"
    parts = [f"ON: rollout calls recorded in the store; token ids from {tokens}"]
    if capture["token_in"]:
        parts.append("token-in " + ", ".join(f"{n} {e}" for n, e in capture["token_in"].items()))
    if capture["files"]:
        parts.append(f"files in {capture['files']}")
    if capture["strict"]:
        parts.append("strict")
    return "; ".join(parts)


#: The login URL's file in the data dir (0600; replaced at every start).
LOGIN_FILE = "admin-login-url"
#: How much of a generated token the banner shows (to tell runs apart, not to log in).
TOKEN_PREFIX_CHARS = 6


def write_login_file(data_dir: Path, login_url: str) -> Path:
    """Write the login URL to ``<data_dir>/admin-login-url``, readable by its owner only
    (created 0600, never widened: an existing file is replaced, not rewritten in place)."""
    path = data_dir / LOGIN_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    fresh = data_dir / f".{LOGIN_FILE}.{os.getpid()}"
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (login_url + "\n").encode())
    finally:
        os.close(fd)
    os.replace(fresh, path)
    return path


def _token_prefix(admin_login_url: str | None) -> str | None:
    if not admin_login_url or "?token=" not in admin_login_url:
        return None
    return admin_login_url.rsplit("?token=", 1)[1][:TOKEN_PREFIX_CHARS] + "..."


def _admin_auth(settings: Settings, admin_login_url: str | None) -> str:
    if settings.admin_token is not None:
        return "admin token required"
    if admin_login_url:  # the URL itself is never a fact (see the module's docstring)
        return "token generated for this run (no --admin-token): open the WebUI login URL"
    return "admin token generated for this run (no --admin-token)"


def _upstream_facts(upstream: Upstream) -> dict[str, Any]:
    parts = urlsplit(upstream.base_url)
    return {
        "name": upstream.name,
        "host": parts.netloc.rsplit("@", 1)[-1],  # never userinfo
        "base_url_path": parts.path or "/",
        "model_map": dict(upstream.model_map),
        "models": sorted(upstream.models) if upstream.models is not None else None,
    }


def startup_facts(
    settings: Settings,
    upstreams: Iterable[Upstream],
    simulator_url: str | None,
    webui: bool,
    admin_login_url: str | None = None,
    sources: dict[str, str] | None = None,
    admin_login_file: Path | None = None,
    managed_keys: Iterable[ManagedKey] = (),
) -> dict[str, Any]:
    """Everything the banner says, as data (no secret: keys are counted, URLs lose their
    userinfo, of a generated admin token only a prefix and where its login URL is).
    ``settings`` are the ones in force (saved values applied); ``sources`` says where the
    stream mode came from; ``managed_keys`` are the store's (they lock /v1 once any exists)."""
    clients = client_auth(settings, managed_keys)
    unique = list({u.name: u for u in upstreams}.values())
    url = listen_url(settings)
    public = getattr(settings, "public_url", None)  # --public-url (one, or a list: the first is shown)
    if isinstance(public, (list, tuple)):
        public = public[0] if public else None
    base = str(public).rstrip("/") if public else url
    hints = [h for h in (base_url_hint(u.base_url) for u in unique if u.name != "simulator") if h]
    if simulator_url is not None:
        hints.append("answers come from the built-in SIMULATOR, not a model: pass --upstream-url for real answers")
    return {
        "version": __version__,
        "listen_url": url,
        "public_url": str(public) if public else None,
        "webui_url": f"{base}/ui/" if webui else None,
        "admin_token_prefix": _token_prefix(admin_login_url),
        "admin_login_file": str(admin_login_file) if admin_login_file else None,
        "stream_mode": str(settings.stream_mode),
        "stream_mode_source": (sources or {}).get("stream_mode", "default"),
        "upstream_stream": settings.upstream_stream,
        "simulator": simulator_url is not None,
        "upstreams": [] if simulator_url is not None else [_upstream_facts(u) for u in unique],
        "store": _store(settings),
        "client_auth": clients.summary(),
        "client_key_required": clients.key_required,
        "managed_keys": clients.managed_keys,
        "admin_auth": _admin_auth(settings, admin_login_url),
        "workers": settings.workers,
        "capture_dir": str(settings.capture_dir) if settings.capture_dir else None,
        "capture": capture_facts(settings, unique),
        "hints": hints,
        "loopback": is_loopback(settings.host),
    }


def _login_where(facts: dict[str, Any], login_url: str | None) -> str | None:
    """The login URL (a terminal), else where it was written; None for a configured token."""
    if login_url:
        return login_url
    if facts.get("admin_login_file"):
        return f"the login URL is in {facts['admin_login_file']} (token {facts['admin_token_prefix']})"
    return None


def _webui_row(facts: dict[str, Any], login_url: str | None) -> str:
    if not facts["webui_url"]:
        return "not installed"
    where = _login_where(facts, login_url)
    if where and login_url:
        return f"{login_url}  (admin console login; the token is for this run only)"
    if where:
        return f"{facts['webui_url']}  ({where})"
    return facts["webui_url"]


_SOURCE_NOTE = {"saved": ", saved in the WebUI/admin API", "env": ", from the environment", "cli": ""}


def render_text(facts: dict[str, Any], login_url: str | None = None) -> str:
    """The terminal form: one aligned ``label  value`` line per fact; ``login_url`` (a
    terminal only) is shown whole."""
    where = _login_where(facts, login_url)
    rows: list[tuple[str, str]] = [
        ("listening", facts["listen_url"] + (f"  (public {facts['public_url']})" if facts["public_url"] else "")),
        ("WebUI", _webui_row(facts, login_url)),
        ("stream mode", f"{facts['stream_mode']}{_SOURCE_NOTE.get(facts['stream_mode_source'], '')} (upstream stream: {facts['upstream_stream']})"),
    ]
    if facts["simulator"]:
        rows.append(("upstream", f"{SIMULATOR} (built-in, scripted answers)"))
    for upstream in facts["upstreams"]:
        detail = upstream["host"] + (upstream["base_url_path"] if upstream["base_url_path"] != "/" else "")
        if upstream["model_map"]:
            detail += "  models " + ", ".join(f"{k} -> {v}" for k, v in upstream["model_map"].items())
        if upstream["models"]:
            detail += "  allow " + ", ".join(upstream["models"])
        rows.append((f"upstream {upstream['name']}", detail))
    if not facts["simulator"] and not facts["upstreams"]:
        rows.append(("upstream", "none configured (add one in the WebUI or with --upstream-url)"))
    rows += [
        ("store", facts["store"]),
        ("clients", facts["client_auth"]),
        ("admin", facts["admin_auth"] if facts["webui_url"] or not where else f"login URL {where}"),
    ]
    if facts["workers"] > 1:
        rows.append(("workers", str(facts["workers"])))
    if facts.get("capture"):
        rows.append(("capture", _capture_row(facts["capture"])))
    rows += [("hint", hint) for hint in facts["hints"]]
    width = max(len(label) for label, _ in rows)
    lines = [f"codebuddy2api {facts['version']}"] + [f"  {label.ljust(width)}  {value}" for label, value in rows]
    return "\n".join(lines) + "\n"


def print_banner(
    facts: dict[str, Any], stream: TextIO | None = None, tty: bool | None = None, login_url: str | None = None
) -> None:
    """Write the banner to ``stream`` (stderr): text on a terminal (with ``login_url``
    whole), else one JSON event in the log's shape (without it: a log keeps it). Written
    directly, so ``--log-level warning`` still shows it."""
    out = stream if stream is not None else sys.stderr
    if tty if tty is not None else out.isatty():
        out.write(render_text(facts, login_url))
    else:
        event = {
            "event": "startup", "level": "info", "logger": "gateway",
            "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"), **facts,
        }
        out.write(orjson.dumps(event).decode() + "\n")
    out.flush()


def announce(
    settings: Settings, upstreams: Iterable[Upstream], simulator_url: str | None, webui: bool,
    login_url: str | None, sources: dict[str, str] | None, data_dir: Path,
    amend: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    managed_keys: Iterable[ManagedKey] = (),
) -> None:
    """The banner at start-up: a generated token's login URL first written to its 0600
    file in ``data_dir`` (the banner names it), then the banner itself. ``amend``: what
    the app adds to the facts (the spill journal's reservation, gateway/generation/recording_gate.py)."""
    path = write_login_file(data_dir, login_url) if login_url else None
    facts = startup_facts(settings, upstreams, simulator_url, webui, login_url, sources, path, managed_keys)
    print_banner(amend(facts) if amend is not None else facts, login_url=login_url)
