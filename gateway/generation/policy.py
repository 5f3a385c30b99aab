"""The per-request policy snapshot: every knob a request obeys, frozen when it starts."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from gateway.settings import Settings, StreamMode
from gateway.stream.think_tags import Start
from gateway.upstream.config_file import model_reasoning_tags


@dataclass(frozen=True, slots=True)
class StreamPolicy:
    """What one generation request runs under. Taken once, never re-read mid-stream."""

    mode: StreamMode
    max_collect_bytes: int
    tool_repair_attempts: int
    keepalive_interval: float
    connect_timeout: float
    first_byte_timeout: float
    idle_timeout: float
    failover_max: int
    upstream_stream: str  # always | never | auto
    engine_extras: dict[str, dict[str, Any]]  # model glob -> extra upstream body fields
    reasoning_tags: dict[str, str] = field(default_factory=dict)  # model glob -> "auto" | "open" (<think> splitting)
    attempt_timeout: float = 1800.0  # one upstream attempt in all (gateway.upstream.bounds)
    max_empty_events: int = 1000  # consecutive upstream events that carry nothing
    pool_timeout: float = 10.0  # waiting for a free upstream connection
    engine_pause_max: float = 600.0  # waiting in the gateway while the engines are paused (gateway/engines/)

    @classmethod
    def snapshot(cls, settings: Settings) -> StreamPolicy:
        buffered = settings.upstream_stream == "never"
        return cls(
            # a buffered upstream has nothing to relay early: both modes act as compatible
            mode=StreamMode.COMPATIBLE if buffered else settings.stream_mode,
            max_collect_bytes=settings.max_collect_bytes,
            tool_repair_attempts=settings.tool_repair_attempts,
            keepalive_interval=settings.keepalive_interval,
            connect_timeout=settings.connect_timeout,
            first_byte_timeout=settings.first_byte_timeout,
            idle_timeout=settings.idle_timeout,
            failover_max=settings.failover_max,
            upstream_stream=settings.upstream_stream,
            engine_extras=settings.engine_extras,
            reasoning_tags={**model_reasoning_tags(settings.config), **settings.reasoning_tags},
            attempt_timeout=settings.attempt_timeout,
            max_empty_events=settings.max_empty_events,
            pool_timeout=settings.upstream_pool_timeout,
            engine_pause_max=settings.engine_pause_max,
        )

    def reasoning_tags_for(self, model: str) -> Start | None:
        """How ``<think>`` tags in this model's content are split (None: left as text)."""
        mode = None
        for pattern, value in self.reasoning_tags.items():
            if fnmatch.fnmatchcase(model, pattern):
                mode = value  # later globs win
        return mode  # type: ignore[return-value]
