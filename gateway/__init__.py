"""codebuddy2api: an LLM streaming gateway."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("codebuddy2api")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"
