"""Per-model options from the TOML config file's ``[models."<glob>"]`` tables.

::

    [models."qwen3*"]
    reasoning_tags = true        # or "auto"; "open" when the template opens <think>

Read once per file version (path and modification time), so a request's policy snapshot
costs a stat, not a parse.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


def model_reasoning_tags(path: Path | None) -> dict[str, str]:
    """model glob -> "auto" | "open" from the config file (empty without one)."""
    if path is None:
        return {}
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return {}
    return dict(_read(str(path), mtime))


@lru_cache(maxsize=8)
def _read(path: str, mtime: int) -> tuple[tuple[str, str], ...]:
    """The file's ``[models]`` tables, validated by the one TOML model (unknown keys refused)."""
    from gateway.upstream.config import load_config_file  # config imports settings; keep this light

    found: list[tuple[str, str]] = []
    for glob, entry in load_config_file(Path(path)).models.items():
        value = entry.reasoning_tags
        if value is False:
            continue
        found.append((glob, "auto" if value is True else value))
    return tuple(found)
