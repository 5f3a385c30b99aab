"""Per-model options from the TOML config file's ``[models."<glob>"]`` tables.

::

    [models."qwen3*"]
    reasoning_tags = true        # or "auto"; "open" when the template opens <think>

Read once per file version (path and modification time), so a request's policy snapshot
costs a stat, not a parse.
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path

from gateway.settings import SettingsError


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
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read --config {path}: {exc}") from None
    found: list[tuple[str, str]] = []
    for glob, entry in (data.get("models") or {}).items():
        value = entry.get("reasoning_tags") if isinstance(entry, dict) else None
        if value is True:
            value = "auto"
        if value in (None, False):
            continue
        if value not in ("auto", "open"):
            raise SettingsError(f'--config {path}: models."{glob}".reasoning_tags must be true, "auto" or "open"')
        found.append((str(glob), str(value)))
    return tuple(found)
