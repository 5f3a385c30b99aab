"""Packaging glue pyproject.toml cannot say: the WebUI (``webui/``, kept at the top of the
source tree) is copied into the built package as ``gateway/webui``, so a wheel serves
``/ui/``. A checkout or an editable install reads ``webui/`` in place (gateway/app.py)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

WEBUI = Path(__file__).resolve().parent / "webui"


class BuildWithWebUI(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode and (WEBUI / "index.html").is_file():
            shutil.copytree(WEBUI, Path(self.build_lib) / "gateway" / "webui", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithWebUI})
