"""``GET /v1/models``: allow-lists, model maps and the upstreams' own lists, through the
openai SDK in strict mode. (Moved from test_pool.py.)"""

from __future__ import annotations

import openai
import pytest

from gateway.simulator.server import create_simulator_app
from tests.conftest import ServerLoop, Simulator, start_gateway


def test_models_lists_what_the_upstreams_serve(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    mapped = Simulator(server_loop.serve(create_simulator_app()))
    config = tmp_path_factory.mktemp("models") / "upstreams.toml"
    config.write_text(f"""
[[upstreams]]
name = "mapped"
base_url = "{mapped.url}/v1"
models = ["qwen3-coder"]
model_map = {{"claude-sonnet" = "text"}}
""")
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, config=config)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    listed = {m.id: m.owned_by for m in client.models.list()}
    assert listed["qwen3-coder"] == "mapped" and listed["claude-sonnet"] == "mapped"
    assert listed["parallel_tools"] == "upstream" and listed["echo"] == "upstream"  # the simulator's own list
