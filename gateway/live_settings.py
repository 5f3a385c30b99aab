"""The settings in force at run time: the flag/env/default ``Settings`` plus the saved layer.

Why a module of its own: :mod:`gateway.settings` defines what a setting is and validates
it once at start-up; this module is the run-time layer on top of it -- which settings the
admin API / WebUI may change (:data:`EDITABLE`), why others are locked
(:class:`LockedSetting`), and :class:`LiveSettings`, which merges saved revisions (from
:mod:`gateway.store.saved_settings`, written by any process) over the start-up values and
hands each request one frozen ``Settings``. Data flows one way: this module imports
:mod:`gateway.settings`, never the reverse.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from gateway.settings import MIN_OPERATOR_SECRET, Settings, SettingsError, Source, describe_error

#: Settings the admin API / WebUI may change at run time (when not set by flag or env).
EDITABLE: frozenset[str] = frozenset({
    "stream_mode", "max_collect_bytes", "tool_repair_attempts", "keepalive_interval",
    "connect_timeout", "first_byte_timeout", "idle_timeout", "max_concurrent", "failover_max",
    "api_key", "upstream_stream", "engine_extras", "audit_bodies", "audit_body_max_bytes",
    "audit_retention_days", "session_header", "rollout_header",
})


class LockedSetting(SettingsError):
    """A change to a value that flag, environment or start-up owns (HTTP 409)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} is {reason} and cannot be changed here")
        self.name = name
        self.reason = reason


def _usable_keys(saved: Any) -> list[str]:
    """The saved client keys still long enough; when none is, one random key nobody holds,
    so a bad saved value (a key shorter than the minimum, saved before it existed) locks
    ``/v1`` (401 for everyone until an operator saves new keys) instead of opening it."""
    import secrets

    keys = [k for k in saved if isinstance(k, str) and len(k) >= MIN_OPERATOR_SECRET] if isinstance(saved, list) else []
    return keys or [secrets.token_urlsafe(32)]


class LiveSettings:
    """The settings in force now: flag/env/default values, plus the saved layer.

    Readers take :attr:`current` once per request (a request's policy is then frozen); it
    notices a new saved revision (written by any process) before answering. Writers go
    through :meth:`update`, which validates like the CLI, refuses source-locked values and
    stale revisions, and replaces the whole frozen object, so no reader sees half an update.
    """

    def __init__(self, settings: Settings, sources: dict[str, Source], saved: Any = None) -> None:
        self._lock = threading.Lock()
        self._base = settings
        self._base_sources: dict[str, Source] = dict(sources)
        self.saved = saved  # gateway.store.saved_settings.SavedSettings, or None (memory only)
        self._current = settings
        self.sources: dict[str, Source] = dict(sources)
        self.revision = 0
        self.listeners: list[Callable[[Settings], None]] = []  # told of every new current value
        if saved is not None:
            self._apply(*saved.load())

    @property
    def current(self) -> Settings:
        """From memory: a newer saved revision the store's poller read is applied here
        (no store read on the request path; see gateway.store.saved_settings)."""
        if self.saved is not None:
            latest = self.saved.latest()
            if latest is None:  # no poller: read now
                if self.saved.revision() != self.revision:
                    with self._lock:
                        self._apply(*self.saved.load())
            elif latest[0] > self.revision:
                with self._lock:
                    if latest[0] > self.revision:
                        self._apply(*latest)
        return self._current

    def locked_reason(self, name: str) -> str | None:
        """Why ``name`` cannot be changed at run time, or None when it can."""
        if name not in Settings.model_fields:
            return "not a setting"
        source = self._base_sources.get(name)
        if source in ("cli", "env"):
            return f"set by {'a command-line flag' if source == 'cli' else 'the environment'} ({source})"
        if name not in EDITABLE:
            return "fixed at start-up"
        return None

    def _apply(self, revision: int, values: dict[str, Any]) -> None:
        usable = {k: v for k, v in values.items() if self.locked_reason(k) is None}
        base = self._base.model_dump()
        try:
            new = Settings.model_validate(base | usable)
        except ValidationError:  # a bad saved value never takes the gateway down: skip it
            good = {}
            for key, value in usable.items():
                try:
                    Settings.model_validate(base | good | {key: value})
                    good[key] = value
                except ValidationError:
                    if key == "api_key":  # fail closed: never open /v1 because a saved key is bad
                        good[key] = _usable_keys(value)
                    continue
            usable = good
            new = Settings.model_validate(base | usable)
        sources = dict(self._base_sources)
        for key in usable:
            sources[key] = "saved"
        self._current, self.sources, self.revision = new, sources, revision
        for listener in self.listeners:
            listener(new)

    def update(
        self, changes: dict[str, Any], revision: int | None = None, actor: str = "admin", unset: tuple[str, ...] = ()
    ) -> Settings:
        """Save ``changes`` (and drop ``unset`` saved values) on top of ``revision``
        (None: whatever is current). Raises LockedSetting, SettingsError or StaleRevision."""
        with self._lock:
            for name in [*changes, *unset]:
                reason = self.locked_reason(name)
                if reason:
                    raise LockedSetting(name, reason)
            try:
                Settings.model_validate(self._current.model_dump() | changes)
            except ValidationError as exc:
                raise SettingsError(describe_error(exc, set(), saved=True)) from None
            expected = self.revision if revision is None else revision
            if self.saved is None:
                if expected != self.revision:
                    from gateway.store.saved_settings import StaleRevision

                    raise StaleRevision(self.revision)
                values = {k: v for k, v in self._current.model_dump().items() if self.sources.get(k) == "saved"}
                values = {k: v for k, v in (values | changes).items() if k not in unset}
                self._apply(self.revision + 1, values)
            else:
                self.saved.write(expected, changes, list(unset), actor)
                self._apply(*self.saved.load())
            return self._current
