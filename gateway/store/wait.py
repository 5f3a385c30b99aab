"""Waiting for PostgreSQL at start-up: a database that is not up yet (the gateway started
before it, or it restarts) is waited for, with one line per attempt on stderr, up to
``--database-wait`` seconds; then one line and exit code 75 (EX_TEMPFAIL: a restart may
succeed, unlike a refused configuration's 2; no traceback).

Only reachability is probed here (a plain connection with a short connect timeout); the
store is opened, and migrated, afterwards as usual.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO
from urllib.parse import urlsplit

#: Seconds between attempts: doubling from the first, up to the cap.
FIRST_BACKOFF, MAX_BACKOFF = 1.0, 10.0
#: Seconds one connection attempt may take.
CONNECT_TIMEOUT = 5.0


class DatabaseUnreachable(Exception):
    """PostgreSQL did not answer within ``--database-wait``; the message is one line."""


def backoff(attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based)."""
    return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (attempt - 1))


def where(url: str) -> str:
    """host:port/db of a URL, without user, password or query (said on stderr)."""
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"


def _reason(exc: BaseException, url: str) -> str:
    """The driver's message on one line, the password masked should it appear."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    password = urlsplit(url).password
    if password:
        text = text.replace(password, "[redacted]")
    return text[:300]


def _connect(url: str, timeout: float) -> None:
    import psycopg

    with psycopg.connect(url, connect_timeout=max(1, int(timeout))):
        pass


def wait_for_database(
    url: str,
    wait: float,
    out: TextIO | None = None,
    connect: Callable[[str, float], None] = _connect,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Return the attempts it took once PostgreSQL accepts a connection; raise
    :class:`DatabaseUnreachable` when ``wait`` seconds passed without one."""
    stream = out if out is not None else sys.stderr
    deadline = clock() + wait
    attempt = 0
    while True:
        attempt += 1
        try:
            connect(url, min(CONNECT_TIMEOUT, max(1.0, deadline - clock())))
            if attempt > 1:
                print(f"codebuddy2api: database {where(url)} is up (attempt {attempt})", file=stream, flush=True)
            return attempt
        except Exception as exc:  # psycopg.OperationalError and kin: the reason is what matters
            reason = _reason(exc, url)
        left = deadline - clock()
        if left <= 0:
            raise DatabaseUnreachable(
                f"database {where(url)} unreachable after {wait:g} s ({attempt} attempt(s)): {reason}"
            )
        pause = min(backoff(attempt), left)
        print(f"codebuddy2api: waiting for database {where(url)} (attempt {attempt}, next in {pause:.0f} s): {reason}",
              file=stream, flush=True)
        sleep(pause)


def describe(exc: BaseException, settings: object) -> str:
    """One line for a database error at start-up: where, and the driver's reason."""
    secret = getattr(settings, "database_url", None)
    url = secret.get_secret_value() if secret is not None else ""
    return f"{where(url)}: {_reason(exc, url)}"
