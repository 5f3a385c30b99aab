"""The code's own hygiene: ruff (pyproject's ``[tool.ruff.lint]``: pyflakes, import order)
over the product, the tests, the bench and the scripts. An unused import or an undefined
name fails here, not in review."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a dev dependency: pip install -e '.[dev]'"
    checked = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
