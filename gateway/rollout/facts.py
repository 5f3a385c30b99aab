"""What an operator is told about rollout capture (the banner, ``GET /admin/api/status``):
pure, settings and upstreams in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.settings import Settings
from gateway.upstream.credential import Upstream


def capture_facts(settings: Settings, upstreams: Iterable[Upstream]) -> dict[str, Any] | None:
    """Whether rollout calls are recorded (the recorder's own rule,
    gateway/rollout/recorder.py) and where their token ids come from; None when off."""
    upstreams = list(upstreams)
    token_sources = {u.name: u.capture_tokens or settings.capture_tokens for u in upstreams
                     if (u.capture_tokens or settings.capture_tokens) != "none"}
    token_in = {u.name: u.token_in for u in upstreams if u.token_in}
    on = bool(settings.capture_dir) or settings.capture_tokens != "none" or settings.token_in != "none" or bool(token_in)
    if not on:
        return None
    return {"token_sources": token_sources, "token_in": token_in, "strict": settings.capture_strict,
            "files": str(settings.capture_dir) if settings.capture_dir else None}
