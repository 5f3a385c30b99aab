"""The real agent CLIs against the gateway and the simulator (``make test-clients``).

Collected only with ``CODEBUDDY2API_CLIENTS=1``: ``make test-clients`` installs the pinned
CLIs (scripts/install_clients.sh, into ~/.cache/codebuddy2api/clients) and runs this
directory inside a loopback-only network namespace (``unshare -n``), so nothing the CLIs
try reaches beyond the machine; the ``isolated`` fixture refuses to run otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.conftest import Gateway, ServerLoop, Simulator

if os.environ.get("CODEBUDDY2API_CLIENTS") != "1":
    collect_ignore_glob = ["test_*.py"]

CLIENTS_DIR = Path(os.environ.get("CLIENTS_DIR", Path.home() / ".cache/codebuddy2api/clients"))
CODEX_VERSION = os.environ.get("CODEX_VERSION", "0.171.0")
CLAUDE_CODE_VERSION = os.environ.get("CLAUDE_CODE_VERSION", "2.1.197")


@dataclass
class Recorded:
    """What reached the gateway: (scope type, method, path) per connection."""

    connections: list[tuple[str, str, str]] = field(default_factory=list)

    def count(self, kind: str, path: str, method: str = "") -> int:
        return sum(1 for t, m, p in self.connections if t == kind and p == path and (not method or m == method))


@dataclass
class ClientGateway(Gateway):
    recorded: Recorded = field(default_factory=Recorded)


def _recording(app: Any, recorded: Recorded) -> Any:
    async def wrapper(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            recorded.connections.append((scope["type"], scope.get("method", ""), scope["path"]))
        await app(scope, receive, send)

    return wrapper


@pytest.fixture(scope="session", autouse=True)
def isolated() -> None:
    """Only inside a network namespace with nothing but loopback."""
    interfaces = sorted(name for _, name in socket.if_nameindex())  # this namespace's, unlike /sys
    if interfaces != ["lo"]:
        pytest.fail(
            f"tests/clients must run in a loopback-only network namespace (make test-clients"
            f" runs them under unshare -n); interfaces here: {interfaces}"
        )
    with socket.socket() as s:  # and loopback works
        s.bind(("127.0.0.1", 0))


@pytest.fixture(scope="session")
def client_gateways(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ClientGateway]:
    out = {}
    for mode in ("compatible", "realtime"):
        settings = Settings(
            upstream_url=[simulator.url + "/v1"], data_dir=tmp_path_factory.mktemp("data"),
            stream_mode=mode, keepalive_interval=2.0,
            capture_tokens="vllm",  # rollout call records (the simulator emulates vLLM's token fields)
        )
        app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
        recorded = Recorded()
        out[mode] = ClientGateway(server_loop.serve(_recording(app, recorded)), app, recorded)
    return out


@pytest.fixture(params=["compatible", "realtime"])
def client_gateway(request: pytest.FixtureRequest, client_gateways: dict[str, ClientGateway]) -> Iterator[ClientGateway]:
    gw = client_gateways[request.param]
    gw.recorded.connections.clear()
    yield gw


def _binary(package_dir: str, name: str) -> Path:
    path = CLIENTS_DIR / package_dir / "node_modules" / ".bin" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/install_clients.sh (make test-clients does)")
    return path


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    return _binary(f"codex-{CODEX_VERSION}", "codex")


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return _binary(f"claude-code-{CLAUDE_CODE_VERSION}", "claude")


@pytest.fixture(scope="session")
def codex_catalog(codex_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model catalog with the simulator's ``agent`` model: the CLI's own metadata for a
    freeform-apply_patch model (``codex debug models``), renamed, so Codex neither warns
    about unknown metadata nor falls back to the JSON patch tool."""
    home = tmp_path_factory.mktemp("codex-catalog-home")
    dump = subprocess.run(
        [str(codex_bin), "debug", "models"], env={**os.environ, "CODEX_HOME": str(home)},
        capture_output=True, text=True, timeout=60, check=True,
    )
    models = json.loads(dump.stdout)["models"]
    template = next(m for m in models if m.get("apply_patch_tool_type") == "freeform" and not m.get("tool_mode"))
    entry = {**template, "slug": "agent", "display_name": "agent", "base_instructions": "You are a scripted test model."}
    path = home / "catalog.json"
    path.write_text(json.dumps({"models": [entry]}))
    return path
